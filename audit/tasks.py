from celery import shared_task
from django.conf import settings


@shared_task(name="audit.export", acks_late=True, ignore_result=True)
def export_audit() -> int:
    from audit.export import audit_export

    return audit_export().rows


@shared_task(name="audit.retention_purge", ignore_result=True)
def purge_audit() -> int:
    from audit.export import audit_retention_purge

    if not settings.AUDIT_RETENTION_DAYS:
        return 0
    return audit_retention_purge(older_than_days=settings.AUDIT_RETENTION_DAYS)
