from django.db import migrations

from memories.engine.vector_schema import create_payload_index, drop_payload_index


def forwards(apps, schema_editor):
    create_payload_index(schema_editor)


def backwards(apps, schema_editor):
    drop_payload_index(schema_editor)


class Migration(migrations.Migration):
    dependencies = [("memories", "0015_vectors_inline")]

    operations = [migrations.RunPython(forwards, backwards)]
