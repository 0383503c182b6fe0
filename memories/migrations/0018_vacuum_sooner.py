"""Autovacuum the engine's table from 2 % dead rows (vector_schema.vacuum_sooner): dead rows
in the HNSW graph cost vector recall until they are vacuumed."""

from django.db import migrations

from memories.engine.vector_schema import vacuum_at_default, vacuum_sooner


def forwards(apps, schema_editor):
    vacuum_sooner(schema_editor)


def backwards(apps, schema_editor):
    vacuum_at_default(schema_editor)


class Migration(migrations.Migration):
    dependencies = [("memories", "0017_owner_fulltext_index")]

    operations = [migrations.RunPython(forwards, backwards)]
