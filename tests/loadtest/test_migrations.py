"""Migrations that move things keep what a database already holds."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("inventory", "0010_strategy_names_from_the_strategies"), ("loadtest", None)]
AFTER = [("inventory", "0011_salerun_moves_to_loadtest"), ("loadtest", "0001_initial")]


def _migrate(targets):
    """Migrate inventory and loadtest to `targets`, every other app to its latest; the models
    as they are then."""
    executor = MigrationExecutor(connection)
    moved = {app for app, _ in targets}
    others = [node for node in executor.loader.graph.leaf_nodes() if node[0] not in moved]
    executor.migrate([*others, *targets])
    executor.loader.build_graph()
    state = [*others, *(node for node in targets if node[1])]
    return executor.loader.project_state(state).apps


def test_sale_runs_move_to_loadtest_with_their_rows_and_permissions():
    try:
        old = _migrate(BEFORE)
        OldRun = old.get_model("inventory", "SaleRun")
        run = OldRun.objects.create(batch="kept", strategy="lua", goodput=12.5)
        ContentType = old.get_model("contenttypes", "ContentType")
        Permission = old.get_model("auth", "Permission")
        User = old.get_model("auth", "User")
        inventory_type, _ = ContentType.objects.get_or_create(
            app_label="inventory", model="salerun"
        )
        ContentType.objects.filter(app_label="loadtest", model="salerun").delete()
        may_start, _ = Permission.objects.get_or_create(
            codename="start_load_run", content_type=inventory_type, defaults={"name": "start"}
        )
        user = User.objects.create(username="starter")
        user.user_permissions.add(may_start)

        new = _migrate(AFTER)
        NewRun = new.get_model("loadtest", "SaleRun")
        assert NewRun.objects.get(pk=run.pk).goodput == 12.5  # the same row, not a copy
        moved = new.get_model("contenttypes", "ContentType").objects.get(pk=inventory_type.pk)
        assert (moved.app_label, moved.model) == ("loadtest", "salerun")
        held = new.get_model("auth", "User").objects.get(pk=user.pk).user_permissions.get()
        assert (held.codename, held.content_type_id) == ("start_load_run", moved.pk)
    finally:
        latest = MigrationExecutor(connection).loader.graph.leaf_nodes()
        _migrate([node for node in latest if node[0] in ("inventory", "loadtest")])
