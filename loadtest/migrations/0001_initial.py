"""SaleRun, moved here from `inventory` (its migration 0011): state only, the table
`inventory_salerun` and its rows stay. The content type follows the model, and with it the
permissions (`start_load_run` among them) and admin log entries that point at it."""

import django.utils.timezone
from django.db import migrations, models


def content_type_follows(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    moved = ContentType.objects.filter(app_label="inventory", model="salerun")
    if not ContentType.objects.filter(app_label="loadtest", model="salerun").exists():
        moved.update(app_label="loadtest")


def content_type_goes_back(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    if not ContentType.objects.filter(app_label="inventory", model="salerun").exists():
        ContentType.objects.filter(app_label="loadtest", model="salerun").update(
            app_label="inventory"
        )


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ("contenttypes", "0002_remove_content_type_name"),
        ("inventory", "0011_salerun_moves_to_loadtest"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
        migrations.CreateModel(
            name='SaleRun',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('batch', models.CharField(db_index=True, help_text='Runs made together share a batch id.', max_length=32)),
                ('strategy', models.CharField(help_text='A strategy name, or `baseline`.', max_length=16)),
                ('sku', models.CharField(blank=True, max_length=64)),
                ('status', models.CharField(choices=[('running', 'Running'), ('done', 'Done'), ('failed', 'Failed')], default='running', max_length=16)),
                ('parameters', models.JSONField(default=dict, help_text='stock, users, spawn rate, duration...')),
                ('started_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('finished_at', models.DateTimeField(blank=True, null=True)),
                ('requests', models.PositiveIntegerField(default=0)),
                ('failures', models.PositiveIntegerField(default=0)),
                ('requests_per_second', models.FloatField(blank=True, null=True)),
                ('goodput', models.FloatField(blank=True, help_text='Accepted units per second.', null=True)),
                ('p50_ms', models.FloatField(blank=True, null=True)),
                ('p95_ms', models.FloatField(blank=True, null=True)),
                ('p99_ms', models.FloatField(blank=True, null=True)),
                ('baseline_requests_per_second', models.FloatField(blank=True, null=True)),
                ('initial_stock', models.PositiveIntegerField(blank=True, null=True)),
                ('accepted_units', models.PositiveIntegerField(blank=True, null=True)),
                ('oversold', models.PositiveIntegerField(blank=True, null=True)),
                ('remaining', models.PositiveIntegerField(blank=True, null=True)),
                ('sold_out_after_seconds', models.FloatField(blank=True, null=True)),
                ('fallback_activations', models.PositiveIntegerField(blank=True, null=True)),
                ('lock_wait_p99_ms', models.FloatField(blank=True, null=True)),
                ('audit', models.JSONField(blank=True, default=dict)),
                ('history', models.JSONField(blank=True, default=list, help_text='Per-second samples: requests/s, p95, units sold.')),
                ('report_dir', models.CharField(blank=True, max_length=500)),
                ('error', models.TextField(blank=True)),
            ],
            options={
                'db_table': 'inventory_salerun',
                'ordering': ['-started_at', '-pk'],
                'permissions': [('start_load_run', 'Can start a load run from the compare page')],
            },
        ),
            ],
        ),
        migrations.RunPython(content_type_follows, content_type_goes_back),
    ]
