from django.db import migrations

from memories.engine.vector_schema import create_lifecycle_columns, drop_lifecycle_columns


def forwards(apps, schema_editor):
    create_lifecycle_columns(schema_editor)


def backwards(apps, schema_editor):
    drop_lifecycle_columns(schema_editor)


class Migration(migrations.Migration):
    """Issue 11: trash and expiry as stored columns, so search need not parse payloads."""

    dependencies = [("memories", "0008_memory_fields")]

    operations = [migrations.RunPython(forwards, backwards)]
