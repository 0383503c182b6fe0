"""OpenAI Responses-style items: their text, a token estimate and content digests.

An item is a JSON object: `{"type": "message", "role": ..., "content": str | [parts]}`
(parts `{"type": "input_text" | "output_text" | "text", "text": ...}`), or
`function_call` (`name`, `arguments`) / `function_call_output` (`output`)."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

# Per-item framing overhead of chat formats (role, separators), in tokens.
ITEM_OVERHEAD_TOKENS = 4
CHARS_PER_TOKEN = 4


def item_parts(item: dict[str, Any]) -> list[str]:
    """The texts an item carries, in order."""
    kind = item.get("type", "message")
    if kind == "function_call":
        return [str(item.get("name") or ""), str(item.get("arguments") or "")]
    if kind == "function_call_output":
        output = item.get("output")
        return [output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)]
    content = item.get("content")
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [str(part.get("text") or "") for part in content if isinstance(part, dict)]
    return []


def item_text(item: dict[str, Any]) -> str:
    return "\n".join(part for part in item_parts(item) if part)


def item_role(item: dict[str, Any]) -> str:
    kind = item.get("type", "message")
    return str(item.get("role") or "") if kind == "message" else kind


def items_token_count(items: list[dict[str, Any]]) -> int:
    """The token estimate `context_token_count` reports: per item, a fixed overhead plus
    one token per four characters of its text (rounded up). Deterministic, no tokenizer."""
    return sum(ITEM_OVERHEAD_TOKENS + math.ceil(len(item_text(item)) / CHARS_PER_TOKEN) for item in items)


def message(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": text}


def _canonical_sha256(value: Any) -> str:
    """The sha256 of `value` as canonical JSON: key order and spacing do not change it."""
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def items_digest(items: list[dict[str, Any]]) -> dict[str, Any]:
    """What an audit row may say about turn content: a hash, lengths and a count."""
    return {
        "sha256": _canonical_sha256(items),
        "items": len(items),
        "chars": sum(len(item_text(item)) for item in items),
    }


def turn_content_sha256(*, input_items: list[dict[str, Any]], output_items: list[dict[str, Any]]) -> str:
    """What a turn said, as one hash: a retry of the turn has the same one, another turn
    sent under the same turn id has not. Stored in place of the items themselves."""
    return _canonical_sha256({"input_items": input_items, "output_items": output_items})
