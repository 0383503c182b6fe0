from django.db import migrations

from memories.engine.vector_schema import create_fulltext_column, drop_fulltext_column


def forwards(apps, schema_editor):
    create_fulltext_column(schema_editor)


def backwards(apps, schema_editor):
    drop_fulltext_column(schema_editor)


class Migration(migrations.Migration):
    dependencies = [("memories", "0004_paging_index")]

    operations = [migrations.RunPython(forwards, backwards)]
