"""Orders lose `order_item_buyer`, an index on (item, buyer) that every sale wrote and no query
read: a buyer's limit is kept in its allowance row (`BuyerAllowance`, unique by sale and buyer),
and the admin's buyer search (`icontains`) cannot use a B-tree. The item's queries keep
`order_item_status`, which leads with the item."""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("inventory", "0017_in_time"),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="order",
            name="order_item_buyer",
        ),
    ]
