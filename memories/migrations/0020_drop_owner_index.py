"""Owner lookups through the paging index only (vector_schema.drop_owner_index): the
neighbour probes of a user unknown to the statistics no longer scan all their rows."""

from django.db import migrations

from memories.engine.vector_schema import create_owner_index, drop_owner_index


def forwards(apps, schema_editor):
    drop_owner_index(schema_editor)


def backwards(apps, schema_editor):
    create_owner_index(schema_editor)


class Migration(migrations.Migration):
    dependencies = [("memories", "0019_live_search_indexes")]

    operations = [migrations.RunPython(forwards, backwards)]
