"""The one dedupe rule's key (docs/architecture.md): a memory's text hashed after
normalising, so texts that differ only in Unicode form, whitespace or case are one.
Apart from `memories.services` so that turn fact extraction (which services imports)
dedupes a turn's facts by the same key."""

from __future__ import annotations

import hashlib
import unicodedata


def content_sha256(text: str) -> str:
    """Hash of the normalised text: Unicode NFKC, whitespace collapsed, case folded."""
    normalised = " ".join(unicodedata.normalize("NFKC", text).split()).casefold()
    return hashlib.sha256(normalised.encode()).hexdigest()
