"""Seal the `conversation_id` in the detail of audit rows written before it was a content
key (seed 003's store_memory: clients choose it freely, so it can name a person), so
erasing their user makes it unreadable too. Rows of a user erased since hold the erased
marker instead: their key is gone, and sealing under a new one would keep them readable."""

from django.db import migrations


def seal_conversation_ids(apps, schema_editor):
    from audit.migrations._sealing import details_seal, erased_after_ids

    details_seal(apps, schema_editor, keys=("conversation_id",), erased_after=erased_after_ids(apps))


class Migration(migrations.Migration):
    dependencies = [("audit", "0014_history_owner_index")]

    # Not reversible into plaintext: unsealing would defeat erasures made since.
    operations = [migrations.RunPython(seal_conversation_ids, migrations.RunPython.noop)]
