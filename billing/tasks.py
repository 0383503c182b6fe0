from celery import shared_task


@shared_task(name="billing.deliver_usage_events", acks_late=True, ignore_result=True)
def deliver_usage_events() -> int:
    """Enqueued when a call commits, and by the beat sweep for retries and leftovers."""
    # Tasks call services and import them here: services import tasks, never the reverse.
    from billing.services import usage_events_deliver

    return usage_events_deliver().delivered
