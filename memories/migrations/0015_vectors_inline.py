"""Keep memory vectors inline in the engine table (vector_schema.keep_vectors_inline):
exact scans stop reading every vector from the TOAST table. Not atomic: VACUUM FULL,
which moves existing vectors back in, cannot run inside a transaction."""

from django.db import migrations

from memories.engine.vector_schema import keep_vectors_inline, reset_toast_target


def forwards(apps, schema_editor):
    keep_vectors_inline(schema_editor)


def backwards(apps, schema_editor):
    reset_toast_target(schema_editor)


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("memories", "0014_tenants")]

    operations = [migrations.RunPython(forwards, backwards)]
