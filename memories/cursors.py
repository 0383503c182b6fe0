"""List cursors: opaque, URL-safe tokens for a position in a list.

The API's list cursor is a (created_at, memory id) position; the web UI's pages seal theirs
(`position_encode`). Decoding is strict (base64url alphabet, a JSON array, each value of
its kind: an ISO-8601 time, a UUID...), so a forged or damaged cursor is a coded
`invalid_argument` at the edge and never reaches the database."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Literal

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from django.conf import settings

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


# --- the web UI's list positions ------------------------------------------------------------
# A position in any list ordered by a unique key: the key's values, kind by kind. "int" a
# bigint id; "time" an aware datetime (a Django DateTimeField); "stamp" an engine
# timestamp, kept as the string the engine compares; "uuid" an id; "text" a bounded string
# (a decision's key). A position sealed (AES-GCM) under a key derived from SECRET_KEY, bound
# to a context (the signed-in user and the list), so nothing in the URL says where it
# points (a decision's key is content), and it cannot be forged nor used by another user
# or on another list.
PositionKind = Literal["int", "time", "stamp", "uuid", "text"]
PositionValue = int | str | datetime | uuid.UUID
POSITION_TEXT_MAX_CHARS = 256
_BIGINT_MAX = 2**63 - 1
_NONCE_BYTES = 12


def _position_cipher() -> AESGCM:
    return AESGCM(hashlib.sha256(f"memsite-list-cursor:{settings.SECRET_KEY}".encode()).digest())


def _context(bound_to: str) -> bytes:
    return f"memsite-list-cursor:{bound_to}".encode()


def _position_value(value: PositionValue) -> int | str:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("a position's time must be timezone-aware")
        return value.isoformat()
    return value if isinstance(value, int) else str(value)


def position_encode(values: Sequence[PositionValue], *, bound_to: str) -> str:
    """The opaque cursor for the position `values`, usable only where `bound_to` is the same."""
    raw = json.dumps([_position_value(v) for v in values], separators=(",", ":")).encode()
    nonce = os.urandom(_NONCE_BYTES)
    sealed = nonce + _position_cipher().encrypt(nonce, raw, _context(bound_to))
    return base64.urlsafe_b64encode(sealed).decode().rstrip("=")


def position_decode(cursor: str, *, kinds: Sequence[PositionKind], bound_to: str) -> tuple[PositionValue, ...]:
    """The values of a position `position_encode` sealed for `bound_to`, checked kind by
    kind; CursorError for anything else (garbage, tampered, another user's or list's)."""
    if not isinstance(cursor, str) or len(cursor) > CURSOR_MAX_CHARS or not _ALPHABET.fullmatch(cursor):
        raise CursorError(_MESSAGE)
    try:
        sealed = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        raw = _position_cipher().decrypt(sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:], _context(bound_to))
        values = json_loads_safe(raw, max_depth=1)
    except (binascii.Error, ValueError, InvalidTag, InputError):
        raise CursorError(_MESSAGE) from None
    if not isinstance(values, list) or len(values) != len(kinds):
        raise CursorError(_MESSAGE)
    return tuple(_position_checked(value, kind) for value, kind in zip(values, kinds, strict=True))


def _position_checked(value: Any, kind: PositionKind) -> PositionValue:
    """One value of a position as its kind, or CursorError (a sealed cursor is ours, but a
    value the database would refuse must still never reach it)."""
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _BIGINT_MAX:
            return value
        raise CursorError(_MESSAGE)
    if not isinstance(value, str) or len(value) > (POSITION_TEXT_MAX_CHARS if kind == "text" else 64):
        raise CursorError(_MESSAGE)
    try:
        if kind == "uuid":
            return str(uuid.UUID(value))
        if kind in ("time", "stamp"):
            when = datetime.fromisoformat(value)
            if kind == "time" and when.tzinfo is None:
                raise ValueError("naive")
            return when if kind == "time" else value
    except ValueError:
        raise CursorError(_MESSAGE) from None
    return value
