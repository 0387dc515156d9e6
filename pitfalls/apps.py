from django.apps import AppConfig


class PitfallsConfig(AppConfig):
    name = "pitfalls"
    verbose_name = "Pitfall lab"

    def ready(self) -> None:
        from shop.admin_site import add_page

        add_page(self.label, "Scenarios", "admin-pitfalls")
