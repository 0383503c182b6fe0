"""What the sealing migrations (0011, 0015, 0016) share: move the content keys of existing audit
rows' `detail` into the sealed envelope, in batches, with progress. The migration's own
transaction lifts the append-only trigger for this and puts it back.
(Django's migration loader skips modules whose name starts with "_".)"""

import sys

from django.db.models import Max, Q

BATCH = 1000


def erased_after_ids(apps) -> dict[int, int]:
    """Subject id -> the id of their last erasure's audit row (for `details_seal`)."""
    event = apps.get_model("audit", "AuditEvent")
    erasures = (
        event.objects.filter(operation__in=("wipe_user_data", "admin_wipe_user_data"), outcome="ok")
        .values("subject_user_id")
        .annotate(last=Max("id"))
    )
    return {row["subject_user_id"]: row["last"] for row in erasures if row["subject_user_id"] is not None}


def _detail_sealed(sealer, detail: dict, keys: tuple[str, ...]) -> dict:
    """`detail` with `keys` sealed. A row that already has a sealed envelope (its query or
    path, say) gets them merged into it, so readers still find one envelope; a row whose
    envelope no longer opens (its user was erased) gets the erased marker instead."""
    from audit.crypto import ERASED, ContentUnreadable, content_open, is_sealed

    envelope = detail.get("content")
    if not is_sealed(envelope):
        return sealer.seal_detail(detail)
    plain = {name: detail[name] for name in keys if detail.get(name) not in (None, "", [], {})}
    if not plain:
        return detail
    try:
        opened = content_open(envelope)
    except ContentUnreadable:
        return {**detail, **{name: ERASED for name in plain}}
    rest = {name: value for name, value in detail.items() if name not in plain}
    return rest | {"content": sealer.seal({**opened, **plain})}


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
            row.detail = _detail_sealed(sealer, row.detail, keys)
        event.objects.bulk_update(batch, ["detail"])
        done, last = done + len(batch), batch[-1].id
        sys.stderr.write(f"  sealing audit details: {done}/{total}\n")
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("ALTER TABLE audit_auditevent ENABLE TRIGGER audit_auditevent_append_only")
