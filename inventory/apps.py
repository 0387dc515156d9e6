from django.apps import AppConfig


class InventoryConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "inventory"
    verbose_name = "Inventory"

    def ready(self) -> None:
        # Once the models are loaded: the Redis breaker's recovery steps need them.
        from .recovery import wire

        wire()
