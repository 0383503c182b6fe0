"""What the sealing migrations (0011, 0015) share: move the content keys of existing audit
rows' `detail` into the sealed envelope, in batches, with progress. The migration's own
transaction lifts the append-only trigger for this and puts it back.
(Django's migration loader skips modules whose name starts with "_".)"""

import sys

from django.db.models import Q

BATCH = 1000


def details_seal(apps, schema_editor, *, keys: tuple[str, ...], erased_after: dict[int, int] | None = None) -> None:
    """Seal `keys` of every row that holds one. `erased_after`: subject id -> the id of
    their last erasure's audit row; rows before it belong to erased data, so their values
    become the erased marker instead of being sealed under a new key (staff could read it)."""
    from audit.crypto import ERASED, Sealer

    event = apps.get_model("audit", "AuditEvent")
    key = apps.get_model("audit", "SubjectKey")
    holds_content = Q()
    for name in keys:
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
            if row.id < (erased_after or {}).get(row.subject_user_id, 0):
                row.detail = {**row.detail, **{name: ERASED for name in keys if name in row.detail}}
                continue
            sealer = sealers.setdefault(row.subject_user_id, Sealer(row.subject_user_id, model=key))
            row.detail = sealer.seal_detail(row.detail)
        event.objects.bulk_update(batch, ["detail"])
        done, last = done + len(batch), batch[-1].id
        sys.stderr.write(f"  sealing audit details: {done}/{total}\n")
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("ALTER TABLE audit_auditevent ENABLE TRIGGER audit_auditevent_append_only")
