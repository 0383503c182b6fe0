"""Crypto-shredding of audit content (issue 14): the `before`/`after` snapshots of an
audit row (memory texts and fields) are sealed with the subject's own data key.

An envelope is `{"sealed": "v1", "key": <SubjectKey pk>, "nonce": b64, "data": b64}`;
the AES-256-GCM associated data binds it to the subject. Opening one whose key was
destroyed (the user was erased) answers ERASED, never an error. Rows written before
sealing existed hold plain JSON and are returned as they are. The content keys of an audit
row's `detail` (a search query, a cache pattern, filter values...) are sealed the same way
under `detail["content"]`.

No per-process cache of data keys: a process could otherwise keep sealing with a key
another process destroyed. The lookup is one indexed row per audited write."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from django.conf import settings
from django.db import connection

from audit.models import SubjectKey

VERSION = "v1"
# Detail keys that can hold what a user said or stored (a search query, a cache pattern,
# filter values, bulk criteria, a decision key, an imported file's path, an error message
# that may quote input, a conversation id, session name or project the client chose
# freely): sealed together under detail["content"].
CONTENT_DETAIL_KEYS = (
    "query", "pattern", "filters", "bulk", "key", "path", "message", "conversation_id", "session_id", "project"
)  # fmt: skip
ERASED = "(erased: the user's data key was destroyed)"


class ContentUnreadable(Exception):
    """An envelope that does not open (its key is gone or the data was tampered with)."""


def _master() -> AESGCM:
    configured = getattr(settings, "AUDIT_MASTER_KEY", "") or ""
    if configured:
        key = base64.b64decode(configured)
        if len(key) != 32:
            raise ValueError("AUDIT_MASTER_KEY must be 32 bytes, base64-encoded")
    else:  # development: derived from SECRET_KEY (set AUDIT_MASTER_KEY in production)
        key = hashlib.sha256(f"audit-master:{settings.SECRET_KEY}".encode()).digest()
    return AESGCM(key)


def _aad(subject_user_id: int) -> bytes:
    return f"memsite-audit-subject:{subject_user_id}".encode()


def _data_key(row: Any) -> bytes:
    wrapped = bytes(row.wrapped)
    return _master().decrypt(wrapped[:12], wrapped[12:], _aad(row.subject_user_id))


def _subject_key_get(subject_user_id: int, *, model: Any) -> Any:
    """The subject's key row (id and wrapped key only), or None. Plain SQL: every audited
    call seals, and compiling `filter().first()` cost more than the lookup (issue 18)."""
    meta = model._meta
    quote = connection.ops.quote_name
    names = ("id", "subject_user_id", "wrapped")
    columns = [quote(meta.get_field(name).column) for name in names]
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {', '.join(columns)} FROM {quote(meta.db_table)} WHERE {columns[1]} = %s",  # noqa: S608 - identifiers from the model
            [subject_user_id],
        )
        found = cursor.fetchone()
    return model.from_db(connection.alias, list(names), found) if found is not None else None


def subject_key_for_sealing(subject_user_id: int, *, model: Any = SubjectKey) -> Any:
    """The subject's key row, created on first use (race-safe: ON CONFLICT DO NOTHING).
    `model`: the migration sealing older rows passes its historical model."""
    row = _subject_key_get(subject_user_id, model=model)
    if row is None:
        nonce = os.urandom(12)
        wrapped = nonce + _master().encrypt(nonce, AESGCM.generate_key(bit_length=256), _aad(subject_user_id))
        model.objects.bulk_create([model(subject_user_id=subject_user_id, wrapped=wrapped)], ignore_conflicts=True)
        row = model.objects.get(subject_user_id=subject_user_id)
    return row


class Sealer:
    """Seals values for one subject with one key lookup and unwrap (an audit row seals up
    to three parts: before, after and the content keys of its detail)."""

    def __init__(self, subject_user_id: int, *, model: Any = SubjectKey) -> None:
        self.subject_user_id = subject_user_id
        self._model = model
        self._row: Any = None
        self._cipher: AESGCM | None = None

    def seal(self, value: Any) -> dict[str, Any] | None:
        """`value` (any JSON) sealed with the subject's data key; None stays None."""
        if value is None:
            return None
        if self._cipher is None:  # the key row is created on the first value that needs it
            self._row = subject_key_for_sealing(self.subject_user_id, model=self._model)
            self._cipher = AESGCM(_data_key(self._row))
        nonce = os.urandom(12)
        data = self._cipher.encrypt(nonce, json.dumps(value).encode(), _aad(self.subject_user_id))
        return {
            "sealed": VERSION,
            "key": self._row.pk,
            "nonce": base64.b64encode(nonce).decode(),
            "data": base64.b64encode(data).decode(),
        }

    def seal_detail(self, detail: dict[str, Any]) -> dict[str, Any]:
        """`detail` with its content keys moved into one sealed `content` envelope."""
        if is_sealed(detail.get("content")):
            return detail
        content = {k: detail[k] for k in CONTENT_DETAIL_KEYS if detail.get(k) not in (None, "", [], {})}
        if not content:
            return detail
        return {k: v for k, v in detail.items() if k not in content} | {"content": self.seal(content)}


def content_seal(value: Any, *, subject_user_id: int, model: Any = SubjectKey) -> dict[str, Any] | None:
    """`value` (any JSON) sealed with the subject's data key; None stays None."""
    return Sealer(subject_user_id, model=model).seal(value)


def is_sealed(value: Any) -> bool:
    return isinstance(value, dict) and value.get("sealed") == VERSION and {"key", "nonce", "data"} <= set(value)


def content_open(value: Any) -> Any:
    """The snapshot a sealed envelope holds; raises ContentUnreadable when its key is gone
    (an erased user) or it was tampered with. Unsealed values are returned as they are."""
    if not is_sealed(value):
        return value
    row = SubjectKey.objects.filter(pk=value["key"]).first()
    if row is None:
        raise ContentUnreadable("the data key of this content was destroyed (the user was erased)")
    try:
        plain = AESGCM(_data_key(row)).decrypt(
            base64.b64decode(value["nonce"]), base64.b64decode(value["data"]), _aad(row.subject_user_id)
        )
    except (InvalidTag, ValueError):
        raise ContentUnreadable("this content does not decrypt") from None
    return json.loads(plain)


def content_display(value: Any) -> Any:
    """For people (the admin): the snapshot, or ERASED."""
    try:
        return content_open(value)
    except ContentUnreadable:
        return ERASED


def subject_key_destroy(subject_user_id: int) -> int:
    """Crypto-shred everything sealed for the subject (in the caller's transaction):
    returns how many keys were destroyed (0 or 1)."""
    deleted, _ = SubjectKey.objects.filter(subject_user_id=subject_user_id).delete()
    return deleted
