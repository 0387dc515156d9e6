"""The Celery queues, all named after one base name (FLASHSALE_TASK_QUEUE).

Paying orders goes to the base queue; giving units back to Redis after it failed there goes to
`<base>.give-back`; the sweeper, the reconciler, load runs and the pitfall lab's runs go to
`<base>.maintenance`. A backlog of one never starves the others: a worker reads all three (its
broker connection takes from each in turn), and a worker of its own can be given one with `-Q`.
"""

from __future__ import annotations

from typing import Any

from kombu import Exchange, Queue


def give_back(base: str) -> str:
    return f"{base}.give-back"


def maintenance(base: str) -> str:
    return f"{base}.maintenance"


def names(base: str) -> list[str]:
    return [base, give_back(base), maintenance(base)]


def declarations(base: str) -> list[Queue]:
    """The queues as Celery declares a default queue: each bound to a direct exchange of its
    name, so deleting one deletes its binding too."""
    return [Queue(name, Exchange(name, type="direct"), routing_key=name) for name in names(base)]


def routes(base: str) -> dict[str, dict[str, str]]:
    return {
        "inventory.tasks.give_back_task": {"queue": give_back(base)},
        "inventory.tasks.sweep_orders_task": {"queue": maintenance(base)},
        "inventory.tasks.reconcile_sales_task": {"queue": maintenance(base)},
        "loadtest.tasks.run_load_batch_task": {"queue": maintenance(base)},
        "pitfalls.tasks.run_pitfall_task": {"queue": maintenance(base)},
    }


def use(app: Any, base: str) -> None:
    """Have app (in this process) publish to and read the queues of base."""
    app.conf.task_default_queue = base
    app.conf.task_queues = declarations(base)
    app.conf.task_routes = routes(base)
