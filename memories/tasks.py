from celery import shared_task


@shared_task(name="memories.rate_windows_prune")
def rate_windows_prune() -> int:
    from memories.rate_limits import rate_windows_prune as prune

    return prune()
