"""The Celery application. Tasks live in each app's tasks.py with explicit names."""

import contextlib
import os
from typing import Any

from celery import Celery, signals
from celery.signals import setup_logging, task_postrun, task_prerun, worker_process_shutdown

from core.request_ids import request_id_bind, request_id_unbind

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


# --- logs and metrics in worker and beat processes ----------------------------------------
@setup_logging.connect
def _setup_logging(**kwargs):  # noqa: ARG001 - signal signature
    """Use settings.LOGGING (request ids, LOG_FORMAT) instead of Celery's own format."""
    import logging.config

    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)


_task_request_ids: dict[str, Any] = {}


@task_prerun.connect
def _bind_task_request_id(task_id=None, **kwargs):  # noqa: ARG001 - signal signature
    """A task run's log lines carry its task id as their request id."""
    if task_id:
        _task_request_ids[task_id] = request_id_bind(task_id)


@task_postrun.connect
def _unbind_task_request_id(task_id=None, **kwargs):  # noqa: ARG001 - signal signature
    token = _task_request_ids.pop(task_id, None)
    if token is not None:
        with contextlib.suppress(ValueError):  # reset from another context (never expected)
            request_id_unbind(token)


@worker_process_shutdown.connect
def _pool_process_dead(pid=None, **kwargs):  # noqa: ARG001 - signal signature
    """A prefork pool process ends: drop its live-gauge metric files."""
    from memsite.observability import multiproc_process_dead

    multiproc_process_dead(pid or os.getpid())


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _redact_database_errors(logger, **kwargs):  # noqa: ARG001 - signal signature
    """Should Celery install its own handlers (it does not while `_setup_logging` is connected:
    settings.LOGGING already redacts), keep DB error text out of them too."""
    from memsite.logfilters import add_redaction

    add_redaction(logger)


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _content_safe_logs(**kwargs):  # noqa: ARG001 - signal signature
    """Celery replaces the root handlers when a worker starts: filter them again."""
    from core.log_safety import install_content_filter

    install_content_filter()
