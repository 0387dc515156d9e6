from django.apps import AppConfig


class LoadtestConfig(AppConfig):
    name = "loadtest"
    verbose_name = "Load runs"

    def ready(self) -> None:
        from django.contrib import admin

        # The admin's home page links to the "Compare strategies" page.
        admin.site.index_template = "admin/flashsale_index.html"
