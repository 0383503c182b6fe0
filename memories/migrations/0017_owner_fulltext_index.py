"""BM25's term lookups through a (owner, fts) GIN index (vector_schema.create_owner_fulltext_index)."""

from django.db import migrations

from memories.engine.vector_schema import create_owner_fulltext_index, drop_owner_fulltext_index


def forwards(apps, schema_editor):
    create_owner_fulltext_index(schema_editor)


def backwards(apps, schema_editor):
    drop_owner_fulltext_index(schema_editor)


class Migration(migrations.Migration):
    dependencies = [("memories", "0016_payload_path_index")]

    operations = [migrations.RunPython(forwards, backwards)]
