from django.db import migrations

from memories.engine.vector_schema import create_paging_index, drop_paging_index


def forwards(apps, schema_editor):
    create_paging_index(schema_editor)


def backwards(apps, schema_editor):
    drop_paging_index(schema_editor)


class Migration(migrations.Migration):
    dependencies = [("memories", "0003_dedupe_rate_windows_identities")]

    operations = [migrations.RunPython(forwards, backwards)]
