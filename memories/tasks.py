from celery import shared_task


@shared_task(name="memories.rate_windows_prune")
def rate_windows_prune() -> int:
    from memories.rate_limits import rate_windows_prune as prune

    return prune()


@shared_task(name="memories.purge_due", autoretry_for=(Exception,), retry_backoff=True, max_retries=5)
def purge_due() -> int:
    """Delete for good: trash past TRASH_RETENTION_DAYS and expired memories."""
    from memories.services import memory_purge_due

    return memory_purge_due()


@shared_task(name="memories.recalls_fold", autoretry_for=(Exception,), retry_backoff=True, max_retries=5)
def recalls_fold() -> int:
    """Fold search audit rows into last_recalled_at / access_count."""
    from memories.services import memory_recalls_fold

    return memory_recalls_fold()


@shared_task(name="memories.ingest_intents_reconcile")
def ingest_intents_reconcile() -> dict[str, int]:
    from memories.services import ingest_intents_reconcile as reconcile

    return reconcile()


@shared_task(name="memories.ingest_intents_prune", autoretry_for=(Exception,), retry_backoff=True, max_retries=5)
def ingest_intents_prune() -> int:
    """Closed ingest intents past INGEST_INTENT_RETENTION_DAYS (open ones are never pruned)."""
    from memories.services import ingest_intents_prune as prune

    return prune()


@shared_task(name="memories.turns_maintenance_nightly", autoretry_for=(Exception,), retry_backoff=True, max_retries=3)
def turns_maintenance_nightly() -> int:
    """Issue 13: maintenance of every recently active agent session (safe to re-run)."""
    from memories.turns.services import turn_maintenance_nightly

    return turn_maintenance_nightly()
