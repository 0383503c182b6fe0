"""The list cursor: an opaque, URL-safe token for a (created_at, memory id) position.

Decoding is strict (base64url alphabet, a JSON pair, an ISO-8601 time, a UUID), so a
forged or damaged cursor is a coded `invalid_argument` at the edge and never reaches the
database."""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from datetime import datetime

from core.inputs import InputError, json_loads_safe

CURSOR_MAX_CHARS = 512
_ALPHABET = re.compile(r"[A-Za-z0-9_-]+")
_MESSAGE = "cursor is not one this server issued"


class CursorError(ValueError):
    pass


def cursor_encode(created_at: str, memory_id: str) -> str:
    raw = json.dumps([created_at, memory_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def cursor_decode(cursor: str) -> tuple[str, str]:
    """(created_at, memory_id) of a cursor this server issued; CursorError otherwise."""
    if not isinstance(cursor, str) or len(cursor) > CURSOR_MAX_CHARS or not _ALPHABET.fullmatch(cursor):
        raise CursorError(_MESSAGE)
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        pair = json_loads_safe(raw, max_depth=2)
    except (binascii.Error, ValueError, InputError):
        raise CursorError(_MESSAGE) from None
    if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(p, str) for p in pair):
        raise CursorError(_MESSAGE)
    created_at, memory_id = pair
    try:
        if created_at:
            datetime.fromisoformat(created_at)
        memory_id = str(uuid.UUID(memory_id)) if len(memory_id) <= 64 else ""
    except ValueError:
        raise CursorError(_MESSAGE) from None
    if not memory_id or len(created_at) > 64:
        raise CursorError(_MESSAGE)
    return created_at, memory_id
