"""SaleRun, a load-run record, moves to the `loadtest` app (its migration 0001 takes it over).

State only: the table `inventory_salerun` and its rows stay where they are.
"""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("inventory", "0010_strategy_names_from_the_strategies"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="SaleRun")],
            database_operations=[],
        ),
    ]
