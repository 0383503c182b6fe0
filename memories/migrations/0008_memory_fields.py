from django.db import migrations, models

from memories.engine.lifecycle import engine_default_attrs


def forwards(apps, schema_editor):
    engine_default_attrs(schema_editor)


class Migration(migrations.Migration):
    """Issue 11: existing memories get the default fields (type user, importance 0.5)."""

    dependencies = [("memories", "0007_rate_events")]

    operations = [
        migrations.CreateModel(
            name="JobWatermark",
            fields=[
                ("name", models.CharField(max_length=64, primary_key=True, serialize=False)),
                ("position", models.BigIntegerField(default=0)),
                ("updated_at", models.DateTimeField(auto_now=True)),
            ],
        ),
        migrations.RunPython(forwards, migrations.RunPython.noop),
    ]
