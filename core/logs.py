"""Log records with the request id on every line, as text or JSON (`LOG_FORMAT`).

Wired in settings.LOGGING: `RequestIdFilter` on the handler stamps each record with the
bound request id (`core.request_ids`) and scrubs bearer tokens and API keys that a
message might carry; `AccessLogFilter` drops the query string from uvicorn's access
lines (the web UI's search box puts the user's words there). Memory content is never
logged on purpose; these filters are the safety net for what a library might echo.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime
from typing import Any

from core.request_ids import request_bound

TEXT_FORMAT = "[%(asctime)s] [%(levelname)s] [rid=%(request_id)s] [%(name)s] %(message)s"

# API keys (msk_<id>_<secret>), our OAuth tokens and codes (mso_at_, mso_rt_, mso_ac_),
# upstream chat API keys (sk-...), bearer tokens, and secrets as key=value in URLs or
# messages or as "key": "value" in JSON, or 'key': 'value' in a Python repr, that a
# library echoes (an OAuth token response). A quoted value may hold escaped quotes.
_SECRET_NAMES = r"(?:access_token|refresh_token|id_token|client_secret|api_key|password|secret|token)"  # noqa: S105 - names, not a secret
_SECRETS = [
    (re.compile(r"msk_[A-Za-z0-9_-]+"), "msk_[redacted]"),
    (re.compile(r"\bmso_[A-Za-z0-9_-]+"), "mso_[redacted]"),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{16,}"), "sk-[redacted]"),
    (re.compile(rf'(?i)("{_SECRET_NAMES}"\s*:\s*")(?:[^"\\]|\\.)*'), r"\1[redacted]"),
    (re.compile(rf"(?i)('{_SECRET_NAMES}'\s*:\s*')(?:[^'\\]|\\.)*"), r"\1[redacted]"),
    (re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+"), r"\1[redacted]"),
    (re.compile(r"(?i)((?:api[_-]?key|token|secret|password)=)[^&\s\"']+"), r"\1[redacted]"),
]


def scrub_secrets(text: str) -> str:
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


class RequestIdFilter(logging.Filter):
    """Adds `request_id` (and `client_request_id`) to every record and scrubs secrets."""

    def filter(self, record: logging.LogRecord) -> bool:
        bound = request_bound()
        record.request_id = bound.request_id if bound else "-"
        record.client_request_id = bound.client_request_id if bound else ""
        message = record.getMessage()
        scrubbed = scrub_secrets(message)
        if scrubbed != message:
            record.msg, record.args = scrubbed, None
        return True


class AccessLogFilter(logging.Filter):
    """uvicorn's access line is `'%s - "%s %s HTTP/%s" %d'` (client, method, path with
    query, version, status): keep the path, drop the query string."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?[query]", *args[3:])
        return True


class Mem0MessageWithheld(logging.Filter):
    """mem0 builds its messages with f-strings that quote memory content (a fact it could
    not store, with the database's error quoting it again; a message or fact it skipped;
    an entity's text): log where it happened instead, never what it said. The traceback,
    if any, stays (ContentSafeFilter renders it without exception messages)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            record.msg = "mem0 %s in %s (line %d): message withheld, it may quote memory content"
            record.args = (record.levelname.lower(), record.funcName, record.lineno)
        return True


class ForeignHostOneLine(logging.Filter):
    """Django logs a request for a host not in ALLOWED_HOSTS as an ERROR with a traceback
    and the header's text ("Invalid HTTP_HOST header: '<what the client sent>'"). Scanners
    send such requests all day: one WARNING line saying what happened, no traceback and
    nothing the client wrote (the access line has the 400)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.msg, record.args = "a request named a host this server does not serve (ALLOWED_HOSTS): 400", ()
        record.exc_info, record.exc_text = None, None
        return True


class TextFormatter(logging.Formatter):
    """`[time] [level] [rid=...] [logger] message`, as in seed 004."""

    def __init__(self, fmt: str | None = None, datefmt: str | None = None, style: Any = "%", **kwargs: Any) -> None:
        super().__init__(fmt or TEXT_FORMAT, datefmt, style, **kwargs)

    def format(self, record: logging.LogRecord) -> str:
        if not hasattr(record, "request_id"):  # a handler without the filter
            record.request_id = "-"
        # RequestIdFilter scrubs the message only; a traceback (exc_text) or stack can echo
        # a key too (a vendor error quoting its request headers), as in the JSON formatter.
        return scrub_secrets(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id, process and,
    when present, the exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": scrub_secrets(record.getMessage()),  # also where no RequestIdFilter is
            "request_id": getattr(record, "request_id", "-"),
            "process": record.process,
        }
        if client_request_id := getattr(record, "client_request_id", ""):
            entry["client_request_id"] = client_request_id
        if record.exc_info:
            entry["exception"] = scrub_secrets(self.formatException(record.exc_info))
        elif record.exc_text:
            entry["exception"] = scrub_secrets(record.exc_text)
        return json.dumps(entry, ensure_ascii=False, default=str)


def logging_config(*, log_format: str, level: str) -> dict[str, Any]:
    """The LOGGING dict for settings (also applied by Celery processes)."""
    formatter = "json" if log_format == "json" else "text"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {
            "request_id": {"()": "core.logs.RequestIdFilter"},
            "access": {"()": "core.logs.AccessLogFilter"},
            "mem0_withheld": {"()": "core.logs.Mem0MessageWithheld"},
            "foreign_host_one_line": {"()": "core.logs.ForeignHostOneLine"},
            # No memory content: tracebacks without exception messages (core/log_safety.py).
            "content_safe": {"()": "core.log_safety.ContentSafeFilter"},
        },
        "formatters": {
            "text": {"()": "core.logs.TextFormatter"},
            "json": {"()": "core.logs.JsonFormatter"},
        },
        "handlers": {
            "console": {
                "class": "logging.StreamHandler",
                "formatter": formatter,
                "filters": ["content_safe", "request_id"],
            },
            "access": {
                "class": "logging.StreamHandler",
                "formatter": formatter,
                "filters": ["content_safe", "access", "request_id"],
            },
        },
        "root": {"handlers": ["console"], "level": level},
        "loggers": {
            # uvicorn configures its own handlers before Django loads; ours replace them. No
            # level: uvicorn's `--log-level` keeps deciding (`warning` turns access lines off).
            "uvicorn": {"handlers": ["console"], "propagate": False},
            "uvicorn.error": {"handlers": ["console"], "propagate": False},
            "uvicorn.access": {"handlers": ["access"], "propagate": False},
            # mem0 and httpx log request bodies and keys at INFO/DEBUG.
            "mem0": {"level": "WARNING"},
            # Their messages quote memory content (Mem0MessageWithheld); a logger's own filter
            # sees only the records logged on it, so each one is named.
            "mem0.memory.main": {"filters": ["mem0_withheld"]},
            "mem0.memory.utils": {"filters": ["mem0_withheld"]},
            "mem0.vector_stores.pgvector": {"filters": ["mem0_withheld"]},
            # Without spaCy mem0 falls back to plain text for BM25 and says so on every call.
            "mem0.utils.spacy_models": {"level": "ERROR"},
            "django.security.DisallowedHost": {"filters": ["foreign_host_one_line"]},
            "httpx": {"level": "WARNING"},
            "httpcore": {"level": "WARNING"},
            "httpx2": {"level": "WARNING"},
            "httpcore2": {"level": "WARNING"},
            # The MCP SDK logs whole JSON-RPC messages (tool arguments: memory text) at DEBUG.
            "mcp": {"level": "INFO"},
            # Stateless mode: "Terminating session: None" at INFO after every request (noise,
            # and a log line's filters and write on every MCP call).
            "mcp.server.streamable_http": {"level": "WARNING"},
        },
    }
