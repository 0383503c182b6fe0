"""The proxy's own error answers (seed 004's table), in OpenAI's error shape so the
official clients raise their usual exceptions. Every one carries `X-Memsite-Error`, so
our 502 is distinguishable from an upstream's 500 (which passes through unchanged)."""

from __future__ import annotations

from core.errors import ErrorCode, ServiceError

ERROR_HEADER = "X-Memsite-Error"


class ProxyError(Exception):
    log_safe_message = True  # core/log_safety.py prints it in tracebacks

    def __init__(self, status: int, code: str, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    def as_body(self) -> dict:
        return {"error": {"message": self.message, "type": "memsite_error", "code": self.code, "param": None}}

    def as_service_error(self) -> ServiceError:
        """For the audit row (audit_failure takes a ServiceError)."""
        code = {
            401: ErrorCode.UNAUTHENTICATED,
            403: ErrorCode.FORBIDDEN,
            404: ErrorCode.NOT_FOUND,
            413: ErrorCode.PAYLOAD_TOO_LARGE,
            422: ErrorCode.INVALID_ARGUMENT,
            429: ErrorCode.RATE_LIMITED,
            499: ErrorCode.CLIENT_GONE,
        }.get(self.status, ErrorCode.BACKEND_UNAVAILABLE)
        if self.status == 500:  # recorded as the dispatcher records an unexpected failure
            return ServiceError(code, "unexpected failure")
        # A refused permission or subject is a denial, as the dispatcher records it.
        return ServiceError(code, self.message, denied=self.status in (403, 404))


def unauthenticated(message: str = "Missing or invalid API key.") -> ProxyError:
    return ProxyError(401, "invalid_api_key", message)


def invalid_messages(message: str) -> ProxyError:
    return ProxyError(422, "invalid_messages", message)


def memory_unavailable(message: str = "Memory retrieval failed; the request was not forwarded.") -> ProxyError:
    return ProxyError(502, "memory_unavailable", message)


def upstream_unreachable() -> ProxyError:
    return ProxyError(502, "upstream_unreachable", "The upstream LLM could not be reached.")


def upstream_address_refused() -> ProxyError:
    return ProxyError(
        502,
        "upstream_address_refused",
        "This key's upstream is not at a public address; this service does not connect to it.",
    )


def request_too_large(message: str = "The request body is too large.") -> ProxyError:
    return ProxyError(413, "request_too_large", message)


# The upstream answered 200 but not with a usable answer. Its bytes are not relayed: the
# client would take a broken or cut-off answer for a whole one, and we would store and
# bill half a turn. Distinct from an upstream error status, which passes through as is.
def upstream_error(message: str = "The upstream LLM sent an answer that is not a chat completion.") -> ProxyError:
    return ProxyError(502, "upstream_error", message)


def upstream_answer_too_large(message: str) -> ProxyError:
    """An answer (or one SSE event) larger than we read: collecting it would hold the
    process's memory, and scanning it its event loop."""
    return ProxyError(502, "upstream_answer_too_large", message)


def upstream_timeout() -> ProxyError:
    return ProxyError(504, "upstream_timeout", "The upstream LLM stopped answering before the answer was complete.")


def recording_failed() -> ProxyError:
    """The answer arrived but the call could not be recorded: withheld, so no call is
    answered without its audit row and usage event."""
    return ProxyError(503, "recording_failed", "The call could not be recorded; its answer was withheld. Retry later.")


def internal_error() -> ProxyError:
    """An unexpected failure (a bug, not the request's fault nor a known outage): the
    proxy's JSON shape instead of Django's HTML 500, and never the exception's text."""
    return ProxyError(500, "internal_error", "The request failed unexpectedly; it was logged. Retry later.")


def backend_unavailable() -> ProxyError:
    """The database could not be reached: retry later (as every surface answers it)."""
    return ProxyError(503, "backend_unavailable", "The database is unavailable; retry later.", retry_after_s=5)


def client_gone() -> ProxyError:
    """Never sent: the audit row of a call whose client closed it before the answer."""
    return ProxyError(499, "client_gone", "The client closed the request before the answer was sent.")
