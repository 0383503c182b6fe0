"""Seal the content keys of the `detail` of audit rows written before they were sealed
(a search query, a cache pattern, filter values...: audit.crypto.CONTENT_DETAIL_KEYS), so
erasing their user makes them unreadable too. Like 0010, this migration alone lifts the
append-only trigger, inside its transaction."""

import sys

from django.db import migrations
from django.db.models import Q

BATCH = 1000


def seal_existing(apps, schema_editor):
    from audit.crypto import CONTENT_DETAIL_KEYS, Sealer

    event = apps.get_model("audit", "AuditEvent")
    key = apps.get_model("audit", "SubjectKey")
    holds_content = Q()
    for name in CONTENT_DETAIL_KEYS:
        holds_content |= Q(detail__has_key=name)
    rows = event.objects.filter(holds_content, subject_user_id__isnull=False)
    total = rows.count()
    if not total:
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("ALTER TABLE audit_auditevent DISABLE TRIGGER audit_auditevent_append_only")
    done, last, sealers = 0, 0, {}
    while True:
        batch = list(rows.filter(id__gt=last).order_by("id")[:BATCH])
        if not batch:
            break
        for row in batch:
            sealer = sealers.setdefault(row.subject_user_id, Sealer(row.subject_user_id, model=key))
            row.detail = sealer.seal_detail(row.detail)
        event.objects.bulk_update(batch, ["detail"])
        done, last = done + len(batch), batch[-1].id
        sys.stderr.write(f"  sealing audit details: {done}/{total}\n")
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("ALTER TABLE audit_auditevent ENABLE TRIGGER audit_auditevent_append_only")


class Migration(migrations.Migration):
    dependencies = [("audit", "0010_seal_existing_snapshots")]

    # Not reversible into plaintext: unsealing would defeat erasures made since.
    operations = [migrations.RunPython(seal_existing, migrations.RunPython.noop)]
