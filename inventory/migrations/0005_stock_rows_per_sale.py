"""Stock rows and buyer allowances belong to a sale, not to the item.

A restarted sale gets rows of its own, so a checkout still in flight for the previous sale can
never take the new sale's units, and restarting never has to delete rows a checkout may hold
locked. Existing rows are given their item's current sale; rows of items with none are dropped.
"""

import django.db.models.deletion
from django.db import migrations, models

ASSIGN = """
UPDATE inventory_stockshard s SET sale_id = i.current_sale_id
    FROM inventory_item i WHERE i.id = s.item_id;
DELETE FROM inventory_stockshard WHERE sale_id IS NULL;
UPDATE inventory_buyerallowance a SET sale_id = i.current_sale_id
    FROM inventory_item i WHERE i.id = a.item_id;
DELETE FROM inventory_buyerallowance WHERE sale_id IS NULL;
"""


def sale_field(related_name: str, *, null: bool) -> models.ForeignKey:
    return models.ForeignKey(
        null=null,
        on_delete=django.db.models.deletion.CASCADE,
        related_name=related_name,
        to="inventory.sale",
    )


class Migration(migrations.Migration):
    dependencies = [("inventory", "0004_all_or_nothing")]

    operations = [
        migrations.AlterModelOptions(name="stockshard", options={"ordering": ["sale", "index"]}),
        migrations.RemoveConstraint(model_name="buyerallowance", name="allowance_unique_buyer"),
        migrations.RemoveConstraint(model_name="stockshard", name="shard_unique_index"),
        migrations.AddField("buyerallowance", "sale", sale_field("allowances", null=True)),
        migrations.AddField("stockshard", "sale", sale_field("shards", null=True)),
        migrations.RunSQL(ASSIGN, migrations.RunSQL.noop),
        migrations.AlterField("buyerallowance", "sale", sale_field("allowances", null=False)),
        migrations.AlterField("stockshard", "sale", sale_field("shards", null=False)),
        migrations.AlterField(
            model_name="item",
            name="stock",
            field=models.IntegerField(
                default=0,
                help_text="Units left, per the database, for an item sold from this row alone; "
                "for one sold from stock rows (shard_count > 0) the sale's starting stock, "
                "folded in again by `sale reconcile`: its units left are the sum of its rows "
                "(units_left).",
            ),
        ),
        migrations.AddConstraint(
            model_name="buyerallowance",
            constraint=models.UniqueConstraint(
                fields=("sale", "buyer"), name="allowance_unique_sale_buyer"
            ),
        ),
        migrations.AddConstraint(
            model_name="stockshard",
            constraint=models.UniqueConstraint(
                fields=("sale", "index"), name="shard_unique_sale_index"
            ),
        ),
    ]
