from django.apps import AppConfig


class LoadtestConfig(AppConfig):
    name = "loadtest"
    verbose_name = "Load runs"

    def ready(self) -> None:
        from shop.admin_site import add_page

        add_page(self.label, "Compare strategies", "admin-compare")
