"""Export of the audit trail to object storage: gzipped JSONL batches plus a manifest
each, under object lock. Resumable and idempotent: the highest exported id is the
watermark; a rerun after a crash finds objects it already wrote (same rows, same bytes)
and does not write them again."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import storages
from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from audit.models import AuditEvent, AuditExportBatch
from core.errors import ServiceError
from core.locks import advisory_lock

logger = logging.getLogger(__name__)


class ExportError(RuntimeError):
    """The export cannot go on (storage refused or holds other bytes); nothing was lost:
    the watermark stays at the last batch recorded, and a rerun resumes there."""


@dataclass
class ExportReport:
    batches: int = 0
    rows: int = 0
    reused_objects: int = 0
    keys: list[str] = field(default_factory=list)


Progress = Callable[[ExportReport], None]


def _encode(rows: list[dict]) -> bytes:
    lines = (json.dumps(row, cls=DjangoJSONEncoder, sort_keys=True, ensure_ascii=False) for row in rows)
    # mtime=0: the same rows always give the same bytes, so a rerun can recognise its own object.
    return gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0)


def _already_written(storage, key: str, digest: str) -> bool:
    if not storage.exists(key):
        return False
    with storage.open(key, "rb") as existing:
        found = hashlib.sha256(existing.read()).hexdigest()
    if found != digest:
        raise ExportError(f"{key} exists with different content (sha256 {found}); refusing to continue")
    return True


def _export_batch(storage, rows: list[dict[str, Any]], report: ExportReport) -> None:
    body = _encode(rows)
    digest = hashlib.sha256(body).hexdigest()
    first_id, last_id = rows[0]["id"], rows[-1]["id"]
    key = f"{first_id:015d}-{last_id:015d}.jsonl.gz"
    manifest_key = f"{first_id:015d}-{last_id:015d}.manifest.json"
    try:
        if _already_written(storage, key, digest):
            report.reused_objects += 1
        else:
            storage.save(key, ContentFile(body))
        if not storage.exists(manifest_key):
            manifest = {
                "object": key,
                "format": "jsonl+gzip",
                "first_id": first_id,
                "last_id": last_id,
                "count": len(rows),
                "sha256": digest,
                "exported_at": timezone.now().isoformat(),
            }
            storage.save(manifest_key, ContentFile(json.dumps(manifest, indent=2).encode()))
    except ExportError:
        raise
    except Exception as exc:  # any backend's failure (OSError, botocore's errors, ...)
        # The type and the backend's own text (a status, a bucket name): no rows, no credentials.
        raise ExportError(f"storage failed on {key}: {type(exc).__name__}: {str(exc)[:300]}") from exc
    with transaction.atomic():
        AuditExportBatch.objects.create(
            first_id=first_id,
            last_id=last_id,
            row_count=len(rows),
            sha256=digest,
            object_key=key,
            manifest_key=manifest_key,
        )
    report.batches += 1
    report.rows += len(rows)
    report.keys.append(key)


def _settled_prefix(rows: Iterable[dict[str, Any]], *, cutoff: datetime) -> Iterator[dict[str, Any]]:
    """The rows, in id order, up to the first one written after `cutoff`. The watermark
    moves by id and never back, and ids and `occurred_at` (each process's clock, read
    before the insert) need not rise together: a batch chosen by time alone could take
    id 101 and leave a later-stamped id 100 behind for ever (and retention would then
    delete it unexported)."""
    for row in rows:
        if row["occurred_at"] >= cutoff:
            return
        yield row


def audit_export(*, batch_size: int | None = None, storage=None, progress: Progress | None = None) -> ExportReport:
    """Export every audit row not exported yet, except the last AUDIT_EXPORT_LAG_S of
    them (so that a transaction still in flight cannot commit a lower id behind us).
    `progress` gets the report after each batch. ExportError if storage fails,
    also if another export is running (it holds the export's lock)."""
    if batch_size is None:
        batch_size = settings.AUDIT_EXPORT_BATCH_SIZE
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    storage = storage or storages["audit"]
    report = ExportReport()
    with ExitStack() as held:
        try:
            held.enter_context(advisory_lock("audit-export", timeout_s=1))
        except ServiceError:  # `resource_busy`, worded for a memory: say what is busy here
            raise ExportError("another audit export is running; run this again when it has finished") from None
        cutoff = timezone.now() - timedelta(seconds=settings.AUDIT_EXPORT_LAG_S)
        while True:
            watermark = AuditExportBatch.objects.aggregate(last=Max("last_id"))["last"] or 0
            following = AuditEvent.objects.filter(id__gt=watermark).order_by("id").values()[:batch_size]
            rows: list[dict[str, Any]] = list(_settled_prefix(following, cutoff=cutoff))  # type: ignore[arg-type]
            if not rows:
                break
            _export_batch(storage, rows, report)
            if progress is not None:
                progress(report)
    logger.info("audit export: %s rows in %s batches", report.rows, report.batches)
    return report


def audit_retention_purge(*, older_than_days: int) -> int:
    """Delete audit rows that are exported and older than the retention period: the
    only path the append-only triggers let through. The triggers check both conditions
    themselves (migration audit 0021), with the database's own floor (at least a day,
    `memsite_audit_policy`): rows younger than it are kept whatever the period says."""
    watermark = AuditExportBatch.objects.aggregate(last=Max("last_id"))["last"] or 0
    with transaction.atomic():
        with transaction.get_connection().cursor() as cursor:
            cursor.execute("SET LOCAL memsite.audit_retention = 'on'")
            cursor.execute("SELECT now() - memsite_audit_retention_floor()")
            floor = cursor.fetchone()[0]
        cutoff = min(timezone.now() - timedelta(days=older_than_days), floor)
        deleted, _ = AuditEvent.objects.filter(id__lte=watermark, occurred_at__lt=cutoff).delete()
    return deleted
