from django.db import migrations

from memories.engine.vector_schema import create_vector_tables, drop_vector_tables


def forwards(apps, schema_editor):
    create_vector_tables(schema_editor)


def backwards(apps, schema_editor):
    drop_vector_tables(schema_editor)


class Migration(migrations.Migration):
    dependencies = [("memories", "0001_initial")]

    operations = [migrations.RunPython(forwards, backwards)]
