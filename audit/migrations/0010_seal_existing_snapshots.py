"""Seal the content snapshots (`before`/`after`) of the audit rows written before
crypto-shredding existed, so erasing their user makes them unreadable too. The audit
table is append-only by trigger; this migration alone lifts it, inside its transaction."""

import sys

from django.db import migrations

BATCH = 1000


def seal_existing(apps, schema_editor):
    from audit.crypto import content_seal, is_sealed

    event = apps.get_model("audit", "AuditEvent")
    key = apps.get_model("audit", "SubjectKey")
    rows = event.objects.filter(subject_user_id__isnull=False).exclude(before__isnull=True, after__isnull=True)
    total = rows.count()
    if not total:
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("ALTER TABLE audit_auditevent DISABLE TRIGGER audit_auditevent_append_only")
    done, last = 0, 0
    while True:
        batch = list(rows.filter(id__gt=last).order_by("id")[:BATCH])
        if not batch:
            break
        for row in batch:
            for field in ("before", "after"):
                value = getattr(row, field)
                if value is not None and not is_sealed(value):
                    setattr(row, field, content_seal(value, subject_user_id=row.subject_user_id, model=key))
        event.objects.bulk_update(batch, ["before", "after"])
        done, last = done + len(batch), batch[-1].id
        sys.stderr.write(f"  sealing audit snapshots: {done}/{total}\n")
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("ALTER TABLE audit_auditevent ENABLE TRIGGER audit_auditevent_append_only")


class Migration(migrations.Migration):
    dependencies = [("audit", "0009_subject_keys")]

    # Not reversible into plaintext: unsealing would defeat erasures made since.
    operations = [migrations.RunPython(seal_existing, migrations.RunPython.noop)]
