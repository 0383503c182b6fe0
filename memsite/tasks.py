import uuid

from celery import shared_task

from memsite.services import broker_messages_cleanup, worker_heartbeat_record


@shared_task(name="memsite.worker_heartbeat")
def worker_heartbeat(token: str | None = None) -> None:
    worker_heartbeat_record(token=token or uuid.uuid4().hex)


@shared_task(name="memsite.broker_cleanup")
def broker_cleanup() -> int:
    return broker_messages_cleanup()
