"""`SaleRepair`: what each repair of a sale found and put right, and by whom."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("inventory", "0015_order_public_id_in_time_order"),
    ]

    operations = [
        migrations.CreateModel(
            name="SaleRepair",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("made_at", models.DateTimeField(auto_now_add=True)),
                (
                    "cause",
                    models.CharField(
                        choices=[
                            ("reconciler", "the periodic reconciler"),
                            ("command", "sale reconcile"),
                            ("redis_back", "Redis back after an outage"),
                            ("process_start", "a web process starting"),
                        ],
                        max_length=16,
                    ),
                ),
                ("changes", models.JSONField(default=list)),
                (
                    "sale",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="repairs",
                        to="inventory.sale",
                    ),
                ),
            ],
            options={"ordering": ["-made_at", "-pk"]},
        ),
    ]
