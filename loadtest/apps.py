from django.apps import AppConfig


class LoadtestConfig(AppConfig):
    name = "loadtest"
    verbose_name = "Load runs"
