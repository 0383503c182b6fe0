from celery import shared_task


@shared_task(name="memories.rate_windows_prune")
def rate_windows_prune() -> int:
    from memories.rate_limits import rate_windows_prune as prune

    return prune()


@shared_task(name="memories.ingest_intents_reconcile")
def ingest_intents_reconcile() -> dict[str, int]:
    from memories.services import ingest_intents_reconcile as reconcile

    return reconcile()
