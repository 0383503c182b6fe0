"""What every successful call leaves behind: one usage event and one audit row."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import transaction

from audit.services import audit_failure, audit_record
from billing.services import usage_event_record
from core.errors import ErrorCode, ServiceError
from core.scope import CallContext, MemoryScope

logger = logging.getLogger(__name__)


def call_succeeded(
    scope: MemoryScope,
    *,
    call: CallContext,
    operation: str,
    memory_ids: list[str] | tuple[str, ...] = (),
    before: Any = None,
    after: Any = None,
    detail: dict[str, Any] | None = None,
) -> None:
    """Call inside the transaction that holds the call's own writes, after everything
    else succeeded: both rows commit with the change or not at all."""
    usage_event_record(scope, operation=operation, call=call)
    audit_record(
        scope, call=call, operation=operation, memory_ids=memory_ids, before=before, after=after, detail=detail
    )


@contextmanager
def failures_audited(scope: MemoryScope, *, call: CallContext, operation: str, memory_id: Any = None) -> Iterator[None]:
    """A call that fails still leaves its one audit row (and no usage event)."""
    try:
        yield
    except ServiceError as error:
        _audit_failure(scope, call, operation, error, memory_id)
        raise
    except Exception:
        _audit_failure(
            scope, call, operation, ServiceError(ErrorCode.BACKEND_UNAVAILABLE, "unexpected failure"), memory_id
        )
        raise


def _audit_failure(scope: MemoryScope, call: CallContext, operation: str, error: ServiceError, memory_id: Any) -> None:
    try:
        with transaction.atomic():
            audit_failure(scope, call=call, operation=operation, error=error, memory_id=memory_id)
    except Exception:  # never hide the caller's error behind an audit failure, but say so
        logger.exception("could not write the audit row for a failed %s call", operation)
