"""What every successful call leaves behind: one usage event and one audit row."""

from __future__ import annotations

from typing import Any

from audit.services import audit_record
from billing.services import usage_event_record
from memories.scope import CallContext, MemoryScope


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
