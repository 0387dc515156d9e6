from django.apps import AppConfig


class InventoryConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "inventory"
    verbose_name = "Inventory"

    def ready(self) -> None:
        # Once the models are loaded: the Redis breaker's recovery steps need them.
        from .recovery import wire

        wire()
        export_metrics_before_use()


def export_metrics_before_use() -> None:
    """This process's series an operator alerts on, at 0 (`metrics.export_before_use`): as it
    starts, and again in each gunicorn worker forked from a master that loaded the app
    (`shop.gunicorn_conf.post_fork`)."""
    from . import metrics
    from .breaker import breaker, broker_breaker
    from .strategies import get_strategy, strategy_names

    strategies = [get_strategy(name) for name in strategy_names()]
    metrics.export_before_use(
        breakers=[breaker.metric, broker_breaker.metric],
        redis_strategies=[strategy.name for strategy in strategies if strategy.uses_redis],
        lock_strategies=[strategy.name for strategy in strategies if strategy.holds_locks],
    )
