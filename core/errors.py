"""Domain failures with a stable machine-readable code, shared by MCP, REST and the UI."""

from __future__ import annotations

from typing import Any

from django.db import models


class ErrorCode(models.TextChoices):
    NOT_FOUND = "not_found"
    INVALID_ARGUMENT = "invalid_argument"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    RATE_LIMITED = "rate_limited"
    CONFIRMATION_REQUIRED = "confirmation_required"
    LLM_UNAVAILABLE = "llm_unavailable"
    BACKEND_UNAVAILABLE = "backend_unavailable"
    CONFLICT = "conflict"
    UNAUTHENTICATED = "unauthenticated"
    FORBIDDEN = "forbidden"
    RESOURCE_BUSY = "resource_busy"  # retryable: the same turn or session is being processed
    # Issue 14: search_web without a configured provider (seed 003's error result).
    WEB_SEARCH_UNAVAILABLE = "web_search_unavailable"
    # Recorded, never answered: the client closed the request before its answer was sent.
    CLIENT_GONE = "client_gone"


HTTP_STATUS = {
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.CONFIRMATION_REQUIRED: 400,
    ErrorCode.LLM_UNAVAILABLE: 503,
    ErrorCode.BACKEND_UNAVAILABLE: 503,
    ErrorCode.CONFLICT: 409,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.RESOURCE_BUSY: 409,
    ErrorCode.WEB_SEARCH_UNAVAILABLE: 503,
    ErrorCode.CLIENT_GONE: 499,  # nginx's "client closed request"
}


class ServiceError(Exception):
    """A failure the caller can act on. `message` is for humans and never holds secrets."""

    log_safe_message = True  # core/log_safety.py prints it in tracebacks

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        retry_after_s: int | None = None,
        details: Any = None,
        denied: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
        self.retry_after_s = retry_after_s
        self.details = details
        # Only for the audit trail (the caller sees a plain not_found): the id exists
        # but belongs to someone else.
        self.denied = denied

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]

    def as_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code.value, "message": self.message}
        if self.retry_after_s is not None:
            body["retry_after_s"] = self.retry_after_s
        if self.details:
            body["details"] = self.details
        return body


def not_found(*, denied: bool = False) -> ServiceError:
    # One message for "missing" and "someone else's": the two must be indistinguishable.
    return ServiceError(ErrorCode.NOT_FOUND, "No memory with that id.", denied=denied)


def backend_unavailable() -> ServiceError:
    return ServiceError(ErrorCode.BACKEND_UNAVAILABLE, "The memory engine is unavailable; retry later.")
