from django.db import migrations

from memories.engine.vector_schema import create_hnsw_index, drop_hnsw_index


def forwards(apps, schema_editor):
    create_hnsw_index(schema_editor)


def backwards(apps, schema_editor):
    drop_hnsw_index(schema_editor)


class Migration(migrations.Migration):
    dependencies = [("memories", "0009_lifecycle_columns")]

    operations = [migrations.RunPython(forwards, backwards)]
