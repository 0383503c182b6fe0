"""The memories admin page without reading the whole engine table
(vector_schema.create_admin_indexes): newest first through an index of (created_at, id),
and the word search through the live rows' full-text index plus one of the trashed rows.

Built CONCURRENTLY: the engine's table takes every memory write, and a plain CREATE INDEX
would block them all while it builds. Concurrent builds cannot run in a transaction,
hence `atomic = False`."""

from django.db import migrations

from memories.engine.vector_schema import create_admin_indexes, drop_admin_indexes


def forwards(apps, schema_editor):
    create_admin_indexes(schema_editor)


def backwards(apps, schema_editor):
    drop_admin_indexes(schema_editor)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0026_turn_guard_content_sha256")]

    operations = [migrations.RunPython(forwards, backwards)]
