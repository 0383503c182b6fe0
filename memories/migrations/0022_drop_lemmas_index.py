"""Drop mem0's keyword-search index on the memories table (vector_schema.drop_lemmas_index):
nothing queries it, and every insert and text update maintained it. New rows no longer
carry the lemmas it indexed (engine.writes); older rows keep theirs, unread."""

from django.db import migrations

from memories.engine.vector_schema import create_lemmas_index, drop_lemmas_index


def forwards(apps, schema_editor):
    drop_lemmas_index(schema_editor)


def backwards(apps, schema_editor):
    create_lemmas_index(schema_editor)


class Migration(migrations.Migration):
    dependencies = [("memories", "0021_analyze_sooner")]

    operations = [migrations.RunPython(forwards, backwards)]
