"""Service-level housekeeping: worker heartbeats, broker cleanup, and the erasure ledger.

The erasure ledger: erasure (`wipe_user_data`) deletes a user's data in one transaction, but
base backups and archived WAL keep it until they rotate out, and a restore to a point before
the erasure would bring it back (audit key included) with no trace of the erasure, whose own
rows were after that point. So every erasure leaves a record next to the backups, outside
the database (`erasures/<utc time>-<id>.json` in BACKUP_DIR or the bucket: the user's pk and
partition key, the time, the request id and whether the account was deleted with it; no
names, no content):

1. `erasure_ledger_record` (registered with `memories.sessions.erasure_register`, so the wipe
   calls it inside its transaction) adds a pending `ErasureLedger` row: an outbox, committed
   or rolled back with the erasure itself.
2. On commit a task (`memsite.erasure_ledger_write`, retried) stores the record durably and
   marks the row written; beat's sweep (`memsite.erasure_ledger_sweep`) retries whatever
   is still pending, so a record is never lost to a broker or target outage.
3. `manage.py restore` leaves a marker in the restored data dir; the first start (the
   launcher, after migrating) runs `erasures_reapply_after_restore`: every ledger record
   whose erasure is not in the restored database (its row, committed with it, is absent)
   is done again through the same erasure service, audited as `erasure_reapply` by
   `system:restore`, before anything is served; so is the account's deletion, when the
   erasure deleted the account (the admin's user delete), or the restore would bring the
   user back with their password, API keys and grants.

With an external DATABASE_URL or BACKUP_ENABLED=false memsite takes no backups, so it keeps
no ledger: `erasures_from_audit` lists erasures from the audit trail instead
(`manage.py erasures --since`), for the operator to keep beside their own backups."""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Callable, Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.db.models import Exists, F, OuterRef
from django.utils import timezone

from audit.models import AuditEvent
from audit.services import audit_record
from core.choices import Channel, Operation
from core.request_ids import request_id_current
from core.scope import CallContext, MemoryScope
from memories.toolkit.services import toolkit_user_data_wipe
from memsite import backup
from memsite.models import ErasureLedger, WorkerHeartbeat
from memsite.tasks import erasure_ledger_write as erasure_ledger_write_task

HEARTBEAT_KEEP = timedelta(days=1)
logger = logging.getLogger(__name__)
Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def worker_heartbeat_record(*, token: str) -> WorkerHeartbeat:
    heartbeat, _ = WorkerHeartbeat.objects.get_or_create(token=token, defaults={"hostname": socket.gethostname()})
    WorkerHeartbeat.objects.filter(seen_at__lt=timezone.now() - HEARTBEAT_KEEP).delete()
    return heartbeat


# Consumed broker messages deleted per statement by `broker_messages_cleanup`.
BROKER_CLEANUP_BATCH = 5000
_BROKER_CLEANUP_BATCH_SQL = """
DELETE FROM kombu_message WHERE id IN (
    SELECT id FROM kombu_message WHERE visible = false AND timestamp <= %s ORDER BY timestamp LIMIT %s
)
"""


def broker_messages_cleanup(*, older_than_s: int | None = None) -> int:
    """Delete consumed messages of kombu's SQLAlchemy transport, which never deletes
    them itself. Returns how many rows went. A no-op on any other broker."""
    if not settings.CELERY_BROKER_URL.startswith("sqla+"):
        return 0
    retention = settings.BROKER_MESSAGE_RETENTION_S if older_than_s is None else older_than_s
    # kombu stamps rows with naive local time (datetime.now) when it consumes them.
    cutoff = datetime.now() - timedelta(seconds=retention)
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass('kombu_message') IS NOT NULL")
        if not cursor.fetchone()[0]:
            return 0
        # A message per task sent: in batches (the helper takes a model; this table is
        # kombu's), oldest first from kombu's index on the timestamp, each statement its own
        # commit outside a transaction.
        deleted = 0
        while True:
            cursor.execute(_BROKER_CLEANUP_BATCH_SQL, [cutoff, BROKER_CLEANUP_BATCH])
            if not cursor.rowcount:
                return deleted
            deleted += cursor.rowcount


# --- the erasure ledger ----------------------------------------------------------------------
def erasure_ledger_enabled() -> bool:
    """memsite backs up only the embedded database it runs, and only with BACKUP_ENABLED."""
    return bool(settings.BACKUP_ENABLED and settings.EMBEDDED_DATABASE)


# The ledger record being re-applied (set by `erasures_reapply` around its wipe), so that
# the wipe's own ledger row carries that record's id: no second record, and a second run
# finds it done.
_reapplying: ContextVar[dict | None] = ContextVar("memsite_erasure_reapplying", default=None)


def erasure_ledger_record(scope: MemoryScope) -> int:
    """The erasure's ledger row, in the erasure's own transaction (the wipe calls it through
    `erasure_register`). Returns 0: it deletes nothing."""
    entry = _reapplying.get()
    if entry is not None and int(entry["user_pk"]) == scope.user_pk:
        ErasureLedger.objects.create(
            id=entry["id"],
            user_pk=scope.user_pk,
            engine_user_id=scope.engine_user_id,
            request_id=str(entry.get("request_id") or "")[:64],
            erased_at=entry["erased_at"],  # parsed by erasure_entries_check
            state=ErasureLedger.State.WRITTEN,  # its record is where it came from
            reapplied_at=timezone.now(),
            account_deleted=_account_deleted(entry),
        )
        return 0
    if not erasure_ledger_enabled():
        return 0
    row = ErasureLedger.objects.create(
        id=uuid.uuid4(),
        user_pk=scope.user_pk,
        engine_user_id=scope.engine_user_id,
        # The request's id: the erasure's audit row carries it too (its first call's).
        request_id=request_id_current()[:64],
        erased_at=timezone.now(),
    )
    ledger_id = str(row.id)
    # robust: a broker down at commit must not turn a committed erasure into an error; the
    # row is pending and beat's sweep writes it.
    transaction.on_commit(lambda: erasure_ledger_write_task.delay(ledger_id), robust=True)
    return 0


def erasure_ledger_account_deleted(scope: MemoryScope) -> None:
    """The erasure in this transaction also deletes the account (registered with
    `erasure_account_deleted_register`): its pending row says so before it commits, so the
    record written from it does. A pending row of an earlier erasure of the same user is
    marked too: the account is gone now, a restore to before that erasure must not bring
    it back either."""
    ErasureLedger.objects.filter(user_pk=scope.user_pk, state=ErasureLedger.State.PENDING).update(account_deleted=True)


def _account_deleted(entry: dict) -> bool:
    """Records written before the flag existed have none: their erasures kept the account."""
    return entry.get("account_deleted") is True


def _ledger_record(row: ErasureLedger) -> dict:
    """What the ledger keeps of an erasure: pseudonymous ids and times, nothing else."""
    return {
        "id": str(row.id),
        "user_pk": row.user_pk,
        "engine_user_id": row.engine_user_id,
        "erased_at": row.erased_at.isoformat(),
        "request_id": row.request_id,
        "account_deleted": row.account_deleted,
    }


def erasure_ledger_write(*, ledger_id: str) -> bool:
    """Store one pending row's record on the backup target and mark it written. Raises
    (after counting the attempt) when the target fails: the task retries, the sweep too.
    False when there was nothing to do (written already, or its erasure rolled back)."""
    row = ErasureLedger.objects.filter(id=ledger_id, state=ErasureLedger.State.PENDING).first()
    if row is None:
        return False
    if not erasure_ledger_enabled():
        return False  # backups turned off since: it stays pending, nothing to write it to
    name = backup.erasure_record_name(erased_at=row.erased_at, ledger_id=str(row.id))
    try:
        # Outside any transaction: a file on another volume, or an S3 PUT.
        backup.erasure_record_store(name=name, record=_ledger_record(row))
    except Exception as exc:
        ErasureLedger.objects.filter(id=row.id).update(attempts=F("attempts") + 1, last_error=type(exc).__name__)
        raise
    ErasureLedger.objects.filter(id=row.id, state=ErasureLedger.State.PENDING).update(
        state=ErasureLedger.State.WRITTEN, written_at=timezone.now(), attempts=F("attempts") + 1, last_error=""
    )
    return True


def erasure_ledger_sweep(*, limit: int = 500) -> int:
    """Write the ledger rows still pending (a task lost with the broker, a target that was
    down); each failure is counted on its row and left for the next sweep. Returns how many
    were written."""
    if not erasure_ledger_enabled():
        return 0
    written = 0
    pending = ErasureLedger.objects.filter(state=ErasureLedger.State.PENDING).order_by("erased_at")
    for ledger_id in pending.values_list("id", flat=True)[:limit]:
        try:
            written += erasure_ledger_write(ledger_id=str(ledger_id))
        except Exception as exc:  # counted on the row; the next sweep retries
            logger.warning("erasure ledger record %s not written yet (%s)", ledger_id, type(exc).__name__)
    return written


# --- re-applying erasures after a restore ---------------------------------------------------
REAPPLY_ACTOR = "system:restore"


@dataclass
class ErasureReapplyReport:
    considered: int = 0
    reapplied: int = 0
    already_in_data: int = 0  # done before the recovery point, or re-applied by an earlier run
    no_such_user: int = 0  # the user did not exist yet at the recovery point
    pending: bool = False  # whether a restore had left erasures to re-apply


class ErasureEntryInvalid(ValueError):
    """A ledger record (or a line of an operator's list) that cannot be re-applied as it is."""


# Bounds of the ledger's columns: an entry past them would fail at its INSERT, after the
# entries before it had been applied.
_USER_PK_LIMIT = 2**63  # user_pk is a bigint
_ENGINE_USER_ID_MAX: int = ErasureLedger._meta.get_field("engine_user_id").max_length or 255  # a CharField's


def _text_problem(value: str) -> str:
    """What Postgres would refuse in a text value (checked before anything is applied)."""
    if "\x00" in value:
        return "contains a NUL character"
    try:
        value.encode()
    except UnicodeEncodeError:
        return "is not valid Unicode"
    return ""


def _entry_problem(entry: Any) -> str:
    if not isinstance(entry, dict):
        return "not a JSON object"
    try:
        if not isinstance(entry.get("id"), str):
            raise ValueError
        uuid.UUID(entry["id"])
    except ValueError:
        return "bad or missing id (a UUID)"
    user_pk = entry.get("user_pk")
    if isinstance(user_pk, bool) or not isinstance(user_pk, int):
        return "bad or missing user_pk (an integer)"
    if not 1 <= user_pk < _USER_PK_LIMIT:
        return "user_pk out of range (1 to 2**63-1)"
    try:
        if not isinstance(entry.get("erased_at"), str):
            raise ValueError
        erased_at = datetime.fromisoformat(entry["erased_at"])
    except ValueError:
        return "bad or missing erased_at (an ISO 8601 time)"
    if erased_at.tzinfo is None:
        return "erased_at has no UTC offset"
    try:
        erased_at.astimezone(UTC)
    except OverflowError:
        return "erased_at out of range"
    engine_user_id = entry.get("engine_user_id")
    if not isinstance(engine_user_id, str) or not engine_user_id:
        return "bad or missing engine_user_id"
    if len(engine_user_id) > _ENGINE_USER_ID_MAX:
        return f"engine_user_id longer than {_ENGINE_USER_ID_MAX} characters"
    if problem := _text_problem(engine_user_id):
        return f"engine_user_id {problem}"
    request_id = entry.get("request_id") or ""
    if not isinstance(request_id, str):
        return "bad request_id"
    if problem := _text_problem(request_id):
        return f"request_id {problem}"
    if not isinstance(entry.get("account_deleted", False), bool):
        return "bad account_deleted (true or false)"
    return ""


def erasure_entries_check(entries: Iterable[Any], *, line_numbers: Sequence[int] | None = None) -> list[dict]:
    """Every entry well formed, or ErasureEntryInvalid naming the first bad one (1-based,
    and its line when `line_numbers` says where each entry came from in a file), before
    anything is applied: a list that failed half-way would leave a restore half erased.
    Returns the entries with `erased_at` parsed (timezone-aware)."""
    checked: list[dict] = []
    for number, entry in enumerate(entries, 1):
        if problem := _entry_problem(entry):
            where = f"line {line_numbers[number - 1]}: " if line_numbers else ""
            raise ErasureEntryInvalid(f"{where}erasure entry {number}: {problem}")
        checked.append({**entry, "erased_at": datetime.fromisoformat(entry["erased_at"])})
    return checked


def erasures_reapply(
    *, entries: Iterable[Any], after: datetime | None, progress: Progress = _quiet
) -> ErasureReapplyReport:
    """Do again every erasure in `entries` (ledger records) timed after `after` that the
    database does not contain: its ledger row is absent (that row commits with the erasure,
    and a re-application adds it too, so a second run does nothing). Each goes through the
    same erasure service as `wipe_user_data` and the admin's action, in its own transaction,
    audited as `erasure_reapply` by `system:restore` with the original erasure's request id.
    An erasure that deleted the account (`account_deleted`) deletes it again in that
    transaction, audited as `admin_delete_user` by `system:restore` (same request id)."""
    report = ErasureReapplyReport()
    wanted = [e for e in erasure_entries_check(entries) if after is None or e["erased_at"] > after]
    wanted.sort(key=lambda e: (e["erased_at"], str(e["id"])))
    report.considered = len(wanted)
    progress(f"{len(wanted)} erasure(s) to check" + (f" after {after.isoformat()}" if after else ""))
    users = get_user_model().objects
    for number, entry in enumerate(wanted, 1):
        label = (
            f"[{number}/{len(wanted)}] erasure {entry['id']} of {entry['erased_at'].isoformat()} "
            f"(user {entry['user_pk']})"
        )
        if ErasureLedger.objects.filter(id=entry["id"]).exists():
            report.already_in_data += 1
            progress(f"{label}: already in the restored data")
            continue
        user = users.filter(pk=entry["user_pk"]).first()
        # A user who joined after the erasure is someone else: after a restore the id
        # sequence goes back, and a new sign-up can get the pk of a user erased after the
        # recovery point.
        if user is None or user.date_joined > entry["erased_at"]:
            # Recorded as done, so that a user who gets this pk later is never erased by a rerun.
            ErasureLedger.objects.create(
                id=entry["id"],
                user_pk=entry["user_pk"],
                engine_user_id=entry["engine_user_id"],
                request_id=str(entry.get("request_id") or "")[:64],
                erased_at=entry["erased_at"],
                state=ErasureLedger.State.WRITTEN,
                reapplied_at=timezone.now(),
                account_deleted=_account_deleted(entry),
            )
            report.no_such_user += 1
            what = "no such user" if user is None else "that id now belongs to a user who joined after the erasure"
            progress(f"{label}: {what} in the restored data, nothing to erase")
            continue
        call = CallContext(channel=Channel.INTERNAL, actor_username=REAPPLY_ACTOR)
        if entry.get("request_id"):  # the original erasure's, whose own audit row the restore lost
            call = replace(call, request_id=str(entry["request_id"])[:64])
        # The user's scope as of the restored data (where their data lies now).
        scope = MemoryScope.for_user(user)
        token = _reapplying.set(entry)
        try:
            with transaction.atomic():
                result = toolkit_user_data_wipe(scope, confirm=True, call=call, operation=Operation.ERASURE_REAPPLY)
                if _account_deleted(entry):
                    audit_record(scope, call=call, operation=Operation.ADMIN_DELETE_USER)
                    user.delete()
        finally:
            _reapplying.reset(token)
        report.reapplied += 1
        deleted = ", account deleted" if _account_deleted(entry) else ""
        progress(f"{label}: re-applied ({result['memories_deleted']} memories erased{deleted})")
    return report


def erasures_reapply_after_restore(*, progress: Progress = _quiet) -> ErasureReapplyReport:
    """What the first start of a restored data dir runs (the launcher, after migrating): the
    ledger's erasures after the restore's recovery point, then the marker goes. Raises if the
    ledger cannot be read; the marker stays, and the next start tries again."""
    marker = backup.erasure_reapply_marker()
    if marker is None:
        return ErasureReapplyReport()
    point = marker.get("recovery_point") or marker["backup_started_at"]
    after = datetime.fromisoformat(point) - backup.REAPPLY_MARGIN
    progress(f"restored from base backup {marker['backup']} to {point}: re-applying the erasures since")
    entries = marker.get("records")
    if entries is None:
        if not marker.get("in_place", True):
            # A copy's own backup target does not hold the source's ledger: never guess.
            raise backup.BackupError(
                "this data dir was restored as a copy, but the restore stopped before it read the erasure "
                "ledger: move the data dir away and run manage.py restore --target-dir again"
            )
        entries = backup.erasure_records(after=after, progress=progress)
    try:
        report = erasures_reapply(entries=entries, after=after, progress=progress)
    except ErasureEntryInvalid as exc:
        raise backup.BackupError(f"the erasure ledger holds a record that cannot be re-applied: {exc}") from None
    report.pending = True
    backup.erasure_reapply_marker_clear()
    progress(
        f"erasures: {report.reapplied} re-applied, {report.already_in_data} already in the data, "
        f"{report.no_such_user} of users created after the recovery point"
    )
    return report


ERASURE_OPERATIONS = (Operation.WIPE_USER_DATA, Operation.ADMIN_WIPE_USER_DATA, Operation.ERASURE_REAPPLY)


def erasures_from_audit(*, since: datetime) -> list[dict]:
    """Erasures since `since` from the audit trail, as ledger records (for an external
    database, whose operator keeps this list beside their own backups). The id is derived
    from the request and the user, so listing twice gives the same ids. `account_deleted`:
    the account's deletion was audited with the erasure's request id (the admin's user
    delete, and its re-application, write both rows in one transaction)."""
    rows = (
        AuditEvent.objects.filter(
            operation__in=ERASURE_OPERATIONS, outcome=AuditEvent.Outcome.OK, occurred_at__gte=since
        )
        .exclude(subject_user_id=None)
        .annotate(
            account_deleted=Exists(
                AuditEvent.objects.filter(
                    operation=Operation.ADMIN_DELETE_USER,
                    outcome=AuditEvent.Outcome.OK,
                    request_id=OuterRef("request_id"),
                    subject_user_id=OuterRef("subject_user_id"),
                ).exclude(request_id="")
            )
        )
        .order_by("occurred_at", "id")
        .values("occurred_at", "request_id", "tenant", "subject_user_id", "account_deleted")
    )
    return [
        {
            "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"memsite:erasure:{r['request_id']}:{r['subject_user_id']}")),
            "user_pk": r["subject_user_id"],
            "engine_user_id": f"{r['tenant']}:{r['subject_user_id']}",  # MemoryScope.engine_user_id
            "erased_at": r["occurred_at"].isoformat(),
            "request_id": r["request_id"],
            "account_deleted": r["account_deleted"],
        }
        for r in rows
    ]
