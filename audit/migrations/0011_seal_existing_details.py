"""Seal the content keys of the `detail` of audit rows written before they were sealed
(a search query, a cache pattern, filter values...: audit.crypto.CONTENT_DETAIL_KEYS), so
erasing their user makes them unreadable too. Like 0010, this migration alone lifts the
append-only trigger, inside its transaction."""

from django.db import migrations


def seal_existing(apps, schema_editor):
    from audit.crypto import CONTENT_DETAIL_KEYS
    from audit.migrations._sealing import details_seal

    details_seal(apps, schema_editor, keys=CONTENT_DETAIL_KEYS)


class Migration(migrations.Migration):
    dependencies = [("audit", "0010_seal_existing_snapshots")]

    # Not reversible into plaintext: unsealing would defeat erasures made since.
    operations = [migrations.RunPython(seal_existing, migrations.RunPython.noop)]
