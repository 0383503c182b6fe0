from celery import shared_task
from celery.signals import worker_ready


@shared_task(name="memories.rate_windows_prune")
def rate_windows_prune() -> int:
    from memories.rate_limits import rate_windows_prune as prune

    return prune()


@shared_task(name="memories.ingest_intents_reconcile")
def ingest_intents_reconcile() -> dict[str, int]:
    from memories.services import ingest_intents_reconcile as reconcile

    return reconcile()


@worker_ready.connect
def _reconcile_at_start(sender, **kwargs) -> None:  # noqa: ARG001
    # A crash may have left intents open: close them as soon as a worker is up.
    sender.app.send_task("memories.ingest_intents_reconcile")
