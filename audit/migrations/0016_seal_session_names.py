"""Seal the `session_id` and `project` in the detail of audit rows written before they were
content keys (seed 002's lifecycle tools and the proxy: clients name sessions and projects
freely, so a name can say who or what they are about), so erasing their user makes them
unreadable too. Rows of a user erased since hold the erased marker instead."""

from django.db import migrations


def seal_session_names(apps, schema_editor):
    from audit.migrations._sealing import details_seal, erased_after_ids

    details_seal(apps, schema_editor, keys=("session_id", "project"), erased_after=erased_after_ids(apps))


class Migration(migrations.Migration):
    dependencies = [("audit", "0015_seal_conversation_ids")]

    # Not reversible into plaintext: unsealing would defeat erasures made since.
    operations = [migrations.RunPython(seal_session_names, migrations.RunPython.noop)]
