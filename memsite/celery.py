"""The Celery application. Tasks live in each app's tasks.py with explicit names."""

import os

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "memsite.settings")

app = Celery("memsite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def _configure_sqlalchemy_transport() -> None:
    """kombu passes transport_options on to create_engine, so the poll interval is set
    on the channel class instead (see DESIGN.md)."""
    from django.conf import settings

    if not settings.CELERY_BROKER_URL.startswith("sqla+"):
        return
    from kombu.transport import sqlalchemy as sqla_transport

    sqla_transport.Channel.polling_interval = settings.CELERY_BROKER_POLL_INTERVAL  # type: ignore[attr-defined]


@app.on_after_configure.connect
def _after_configure(sender, **kwargs):  # noqa: ARG001 - signal signature
    _configure_sqlalchemy_transport()


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _redact_database_errors(logger, **kwargs):  # noqa: ARG001 - signal signature
    """Celery installs its own handlers (replacing settings.LOGGING's): keep DB error text out."""
    from memsite.logfilters import add_redaction

    add_redaction(logger)
