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


@shared_task(name="audit.auth_failures_prune", ignore_result=True)
def prune_auth_failures() -> int:
    from audit.services import auth_failure_windows_prune

    return auth_failure_windows_prune()
