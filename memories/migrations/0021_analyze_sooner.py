"""Autovacuum analyses the engine's table from 2 % changed rows (vector_schema.analyze_sooner):
a new user's searches are planned with their real size sooner."""

from django.db import migrations

from memories.engine.vector_schema import analyze_at_default, analyze_sooner


def forwards(apps, schema_editor):
    analyze_sooner(schema_editor)


def backwards(apps, schema_editor):
    analyze_at_default(schema_editor)


class Migration(migrations.Migration):
    dependencies = [("memories", "0020_drop_owner_index")]

    operations = [migrations.RunPython(forwards, backwards)]
