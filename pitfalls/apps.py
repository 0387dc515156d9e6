from django.apps import AppConfig


class PitfallsConfig(AppConfig):
    name = "pitfalls"
    verbose_name = "Pitfall lab"
