from celery import shared_task


@shared_task(name="toolkit.enrich_memories", autoretry_for=(Exception,), retry_backoff=True, max_retries=5)
def enrich_memories(memory_ids: list[str]) -> int:
    """Enrich the long-term candidates one store_memory call made."""
    from memories.toolkit.services import toolkit_candidates_enrich

    return toolkit_candidates_enrich(memory_ids=memory_ids, limit=len(memory_ids))


@shared_task(name="toolkit.enrich_pending", autoretry_for=(Exception,), retry_backoff=True, max_retries=5)
def enrich_pending() -> int:
    """The sweep: candidates whose task was lost (broker down at commit) still get enriched."""
    from memories.toolkit.services import toolkit_pending_sweep

    return toolkit_pending_sweep()


@shared_task(name="toolkit.cache_purge_expired", autoretry_for=(Exception,), retry_backoff=True, max_retries=5)
def cache_purge_expired() -> dict[str, int]:
    """Delete expired cache entries and decisions (already invisible to every read)."""
    from memories.toolkit.services import toolkit_expired_purge

    return toolkit_expired_purge()
