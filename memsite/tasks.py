import logging
import uuid

from celery import shared_task

logger = logging.getLogger(__name__)

# Tasks import their services inside the function: services import tasks, never the reverse.


@shared_task(name="memsite.worker_heartbeat")
def worker_heartbeat(token: str | None = None) -> None:
    from memsite.services import worker_heartbeat_record

    worker_heartbeat_record(token=token or uuid.uuid4().hex)


@shared_task(name="memsite.broker_cleanup")
def broker_cleanup() -> int:
    from memsite.services import broker_messages_cleanup

    return broker_messages_cleanup()


@shared_task(name="memsite.backup_base_if_due", acks_late=False)
def backup_base_if_due() -> str | None:
    # acks_late off: a worker killed mid-backup must not make the broker start another at once;
    # the next beat tick (or the launcher) takes it again. Leftover staging is cleaned then.
    from memsite.backup import BackupError
    from memsite.backup import backup_base_if_due as take

    try:
        meta = take()
    except BackupError as exc:
        logger.error("scheduled base backup failed: %s", exc)
        raise
    return meta["label"] if meta else None


@shared_task(
    name="memsite.erasure_ledger_write",
    autoretry_for=(Exception,),
    retry_backoff=True,
    retry_backoff_max=600,
    max_retries=8,
)
def erasure_ledger_write(ledger_id: str) -> bool:
    """Enqueued when an erasure commits: its record onto the backup target. Retried with
    backoff; past the last retry the row is still pending and beat's sweep takes it."""
    from memsite.services import erasure_ledger_write as write

    return write(ledger_id=ledger_id)


@shared_task(name="memsite.erasure_ledger_sweep", autoretry_for=(Exception,), retry_backoff=True, max_retries=5)
def erasure_ledger_sweep() -> int:
    """Every ledger record still pending (broker or target down when its erasure committed)."""
    from memsite.services import erasure_ledger_sweep as sweep

    return sweep()
