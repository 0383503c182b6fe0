import logging
import uuid

from celery import shared_task

from memsite.services import broker_messages_cleanup, worker_heartbeat_record

logger = logging.getLogger(__name__)


@shared_task(name="memsite.worker_heartbeat")
def worker_heartbeat(token: str | None = None) -> None:
    worker_heartbeat_record(token=token or uuid.uuid4().hex)


@shared_task(name="memsite.broker_cleanup")
def broker_cleanup() -> int:
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
