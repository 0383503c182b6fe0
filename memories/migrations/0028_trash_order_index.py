from django.db import migrations

from memories.engine.vector_schema import create_trash_order_index, drop_trash_order_index


def forwards(apps, schema_editor):
    create_trash_order_index(schema_editor)


def backwards(apps, schema_editor):
    drop_trash_order_index(schema_editor)


class Migration(migrations.Migration):
    atomic = False  # built CONCURRENTLY: the engine's table takes every memory write

    dependencies = [("memories", "0027_admin_listing_indexes")]

    operations = [migrations.RunPython(forwards, backwards)]
