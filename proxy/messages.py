"""Chat messages: validation (422), the turn as session items, history back as chat
messages, the memory block in the system prompt, and the answer collected from a
response (whole or SSE chunks). Pure functions, no I/O."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from proxy.errors import invalid_messages

ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
SYSTEM_ROLES = {"system", "developer"}
MAX_MESSAGES = 5000


def chat_body_parse(raw: bytes) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The request body and its validated messages; 422 for anything unusable."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise invalid_messages("The body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise invalid_messages("The body must be a JSON object.")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_messages("messages must be a non-empty list.")
    if len(messages) > MAX_MESSAGES:
        raise invalid_messages(f"At most {MAX_MESSAGES} messages.")
    if "stream" in body and not isinstance(body["stream"], bool | None):
        raise invalid_messages("stream must be a boolean.")
    for index, message in enumerate(messages):
        _message_check(index, message)
    return body, messages


def _message_check(index: int, message: Any) -> None:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid_messages(f"{where} must be an object.")
    role = message.get("role")
    if role not in ROLES:
        raise invalid_messages(f"{where}.role must be one of {sorted(ROLES)}.")
    content = message.get("content")
    if content is not None and not isinstance(content, str | list):
        raise invalid_messages(f"{where}.content must be a string or a list of parts.")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid_messages(f"{where}: a tool message needs tool_call_id.")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant" or not isinstance(tool_calls, list):
            raise invalid_messages(f"{where}.tool_calls must be a list on an assistant message.")
        for call in tool_calls:
            if not isinstance(call, dict) or not isinstance(call.get("id"), str):
                raise invalid_messages(f"{where}.tool_calls entries need an id.")
    if content is None and role in ("user", "system", "developer", "tool"):
        raise invalid_messages(f"{where}.content is required for role {role}.")
    if role == "assistant" and content is None and not tool_calls and message.get("function_call") is None:
        raise invalid_messages(f"{where}: an assistant message needs content or tool_calls.")


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def last_user_text(messages: list[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            return text_of(message.get("content"))
    return ""


# --- chat messages <-> session items (Responses-style) ---------------------------------
def turn_items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """User/assistant/tool messages as session items; system messages and
    reasoning_content left out, tool calls kept."""
    items: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role in SYSTEM_ROLES:
            continue
        if role in ("tool", "function"):
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": message.get("tool_call_id") or message.get("name") or "",
                    "output": text_of(message.get("content")),
                }
            )
            continue
        content = message.get("content")
        if content is not None and content != "":
            items.append({"type": "message", "role": role, "content": content})
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            items.append(
                {
                    "type": "function_call",
                    "call_id": call.get("id", ""),
                    "name": function.get("name", ""),
                    "arguments": function.get("arguments", ""),
                }
            )
    return items


def history_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Session items back as chat messages. Tool outputs whose call fell out of the
    window are dropped (an orphan tool message is refused by OpenAI-style upstreams)."""
    messages: list[dict[str, Any]] = []
    known_calls: set[str] = set()
    for item in items:
        kind = item.get("type")
        if kind == "message" and item.get("role") in ("user", "assistant"):
            messages.append({"role": item["role"], "content": item.get("content")})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id", ""),
                "type": "function",
                "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")},
            }
            known_calls.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant" and isinstance(last.get("content"), str):
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output" and item.get("call_id") in known_calls:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item.get("output", "")})
    return messages


def messages_enrich(
    messages: list[dict[str, Any]], *, memory_block: str | None, history: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """[system + memory block] [history] [the request's other messages]."""
    enriched = [dict(m) for m in messages]
    system_at = next((i for i, m in enumerate(enriched) if m.get("role") == "system"), None)
    if memory_block:
        if system_at is None:
            enriched.insert(0, {"role": "system", "content": memory_block})
            system_at = 0
        else:
            system = enriched[system_at]
            content = system.get("content")
            if isinstance(content, list):
                system["content"] = [*content, {"type": "text", "text": memory_block}]
            else:
                system["content"] = f"{content}\n\n{memory_block}" if content else memory_block
    insert_at = 0 if system_at is None else system_at + 1
    return [*enriched[:insert_at], *history, *enriched[insert_at:]]


# --- the answer, collected on the side -------------------------------------------------
@dataclass
class Answer:
    content: str = ""
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    _buffer: bytes = b""

    def as_message(self) -> dict[str, Any] | None:
        calls = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        if not self.content and not calls:
            return None
        message: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if calls:
            message["tool_calls"] = calls
        return message

    def take_message(self, message: dict[str, Any]) -> None:
        """A non-streaming answer's choices[0].message (reasoning_content ignored)."""
        self.content = text_of(message.get("content"))
        for index, call in enumerate(message.get("tool_calls") or []):
            if isinstance(call, dict):
                function = call.get("function") or {}
                self.tool_calls[index] = {
                    "id": call.get("id", ""),
                    "type": "function",
                    "function": {"name": function.get("name", ""), "arguments": function.get("arguments", "")},
                }

    def feed(self, data: bytes) -> None:
        """SSE bytes as they pass through; events are parsed once complete."""
        self._buffer += data
        while True:
            cut = _event_end(self._buffer)
            if cut is None:
                return
            event, self._buffer = self._buffer[: cut[0]], self._buffer[cut[1] :]
            self._event(event)

    def _event(self, event: bytes) -> None:
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if not data or data == b"[DONE]":
                continue
            try:
                chunk = json.loads(data)
                delta = chunk["choices"][0].get("delta") or {}
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                continue
            if isinstance(delta.get("content"), str):
                self.content += delta["content"]
            for call in delta.get("tool_calls") or []:
                if not isinstance(call, dict):
                    continue
                empty = {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                slot = self.tool_calls.setdefault(int(call.get("index") or 0), empty)
                if call.get("id"):
                    slot["id"] = call["id"]
                function = call.get("function") or {}
                slot["function"]["name"] += function.get("name") or ""
                slot["function"]["arguments"] += function.get("arguments") or ""


def _event_end(buffer: bytes) -> tuple[int, int] | None:
    ends = [(i, i + len(sep)) for sep in (b"\r\n\r\n", b"\n\n") if (i := buffer.find(sep)) >= 0]
    return min(ends) if ends else None
