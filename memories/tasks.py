from celery import shared_task

from memories.ratelimit import rate_windows_prune as prune


@shared_task(name="memories.rate_windows_prune")
def rate_windows_prune() -> int:
    return prune()
