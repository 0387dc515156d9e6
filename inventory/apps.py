from django.apps import AppConfig


class InventoryConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "inventory"
    verbose_name = "Inventory"

    def ready(self) -> None:
        # Once the models are loaded: the Redis breaker's recovery steps need them.
        from . import metrics
        from .breaker import breaker, broker_breaker
        from .recovery import wire
        from .strategies import get_strategy, strategy_names

        wire()
        strategies = [get_strategy(name) for name in strategy_names()]
        metrics.export_before_use(
            breakers=[breaker.metric, broker_breaker.metric],
            redis_strategies=[strategy.name for strategy in strategies if strategy.uses_redis],
            lock_strategies=[strategy.name for strategy in strategies if strategy.holds_locks],
        )
