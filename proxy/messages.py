"""Chat messages: validation (422), the turn as session items, history back as chat
messages, the memory block in the system prompt, and the answer collected from a
response (whole or SSE chunks). Pure functions, no I/O."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from core.inputs import InputError, json_depth_check
from memories.sessions import session_item_hash
from proxy.errors import invalid_messages, request_too_large, upstream_answer_too_large, upstream_error

ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
SYSTEM_ROLES = {"system", "developer"}
MAX_MESSAGES = 5000
# Looser than core.inputs' defaults (32 levels, 20,000 values): a long agent session or a
# deep tool schema is a legitimate chat body; the upload limit bounds the rest.
MAX_BODY_DEPTH = 64
MAX_BODY_VALUES = 500_000
MAX_MODEL_CHARS = 256
# What Postgres cannot store (NUL in text and jsonb; lone surrogates are not UTF-8). Other
# control characters are refused on memory surfaces but pass here: tool outputs carry
# terminal escapes and form feeds, and the proxy must stay transparent to them.
_UNSTORABLE = re.compile(r"[\x00\ud800-\udfff]")
_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n")


def chat_body_parse(raw: bytes) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The request body and its validated messages; 422 for anything unusable (413 for
    too many values). Everything is checked here, before the upstream or the database
    sees it: a value the database refuses would otherwise lose the recorded turn."""
    body = _body_load(raw)
    if not isinstance(body, dict):
        raise invalid_messages("The body must be a JSON object.")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_messages("messages must be a non-empty list.")
    if len(messages) > MAX_MESSAGES:
        raise invalid_messages(f"At most {MAX_MESSAGES} messages.")
    if "stream" in body and not isinstance(body["stream"], bool | None):
        raise invalid_messages("stream must be a boolean.")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or len(model) > MAX_MODEL_CHARS):
        raise invalid_messages(f"model must be a string of at most {MAX_MODEL_CHARS} characters.")
    for name in _INT_FIELDS:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise invalid_messages(f"{name} must be a positive integer.")
    for index, message in enumerate(messages):
        _message_check(index, message)
    return body, messages


def _body_load(raw: bytes) -> Any:
    """json.loads without RecursionError (depth counted first, core.inputs), then every
    string and key checked for what cannot be stored, and numbers for NaN/Infinity
    (json.dumps would forward them as invalid JSON)."""
    try:
        text = raw.decode("utf-8")
        json_depth_check(text, max_depth=MAX_BODY_DEPTH)
        value = json.loads(text)
    except InputError as exc:
        raise invalid_messages(f"The body is not acceptable JSON: {exc.message}.") from None
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise invalid_messages("The body is not valid JSON.") from None
    _relayed_messages_clean(value)
    _value_check(value)
    return value


# Messages whose text the client relays rather than writes: the model's answers (we relay
# an answer's NUL unchanged, and store it replaced) and tools' outputs (a binary file read).
_RELAYED_ROLES = frozenset({"assistant", "tool", "function"})


def _relayed_messages_clean(body: Any) -> None:
    """NUL and lone surrogates in the string values of relayed messages become U+FFFD, as
    an answer's are when stored: refused, they would lock the conversation (every later
    request resends them). The client's own messages are still refused with them."""
    messages = body.get("messages") if isinstance(body, dict) else None
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, dict) and message.get("role") in _RELAYED_ROLES:
            _strings_clean(message)


def _strings_clean(item: dict[str, Any] | list[Any]) -> None:
    """In place; the depth is bounded (MAX_BODY_DEPTH, checked before parsing). Keys stay
    as they are: one that cannot be stored is refused by _value_check."""
    slots: list[tuple[Any, Any]] = list(item.items()) if isinstance(item, dict) else list(enumerate(item))
    for slot, child in slots:
        if isinstance(child, str):
            if _UNSTORABLE.search(child):
                item[slot] = _UNSTORABLE.sub("\ufffd", child)
        elif isinstance(child, dict | list):
            _strings_clean(child)


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")


def _value_check(value: Any) -> None:
    """Iterative walk (no recursion). The message says where, never what: only plain
    key names are named."""
    stack: list[tuple[Any, str]] = [(value, "")]
    seen = 0
    while stack:
        item, where = stack.pop()
        seen += 1
        if seen > MAX_BODY_VALUES:
            raise request_too_large(f"The body holds more than {MAX_BODY_VALUES} JSON values.")
        if isinstance(item, str):
            if _UNSTORABLE.search(item):
                raise invalid_messages(f"{where or 'The body'} contains a NUL character or a lone surrogate.")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise invalid_messages(f"{where or 'The body'}: numbers must be finite.")
        elif isinstance(item, dict):
            for key, child in item.items():
                if _UNSTORABLE.search(key):
                    raise invalid_messages(f"{where or 'The body'} has a key with a NUL character or a lone surrogate.")
                name = key if _PLAIN_KEY.fullmatch(key) else "?"
                stack.append((child, f"{where}.{name}" if where else name))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(item))


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
    if role == "function" and not isinstance(message.get("name"), str):
        raise invalid_messages(f"{where}: a function message needs a name.")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant" or not isinstance(tool_calls, list):
            raise invalid_messages(f"{where}.tool_calls must be a list on an assistant message.")
        for call in tool_calls:
            if not isinstance(call, dict) or not isinstance(call.get("id"), str):
                raise invalid_messages(f"{where}.tool_calls entries need an id.")
            # Stored as session items and sent back as history: the shape must hold.
            function = call.get("function")
            if not isinstance(function, dict) or not all(
                isinstance(function.get(name, ""), str) for name in ("name", "arguments")
            ):
                raise invalid_messages(f"{where}.tool_calls entries need a function object with string fields.")
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


def history_messages(
    items: list[dict[str, Any]], *, repeated: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Session items back as chat messages. `repeated`: the request's own items
    (`turn_items`); the history's last items that the request repeats (a client resending
    the whole conversation, the usual pattern: `conversation_overlap`) are left out, or the
    upstream would see them twice. `messages_enrich` then keeps only the tool calls that
    are answered."""
    covered, _ = conversation_overlap(
        [session_item_hash(item) for item in items], [session_item_hash(item) for item in repeated or []]
    )
    items = items[: len(items) - covered]
    messages: list[dict[str, Any]] = []
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
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant" and isinstance(last.get("content"), str):
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id", ""), "content": item.get("output", "")}
            )
    return messages


# The request's positions holding the log's last item that are tried, latest first: the
# request's own end is where a resent conversation meets the log, so this bounds the work
# on a request of thousands of repeated items without missing it.
_OVERLAP_ANCHORS = 64


def conversation_overlap(log: list[str], request: list[str]) -> tuple[int, int]:
    """Where a request meets the session log (both as `session_item_hash`es, oldest first):
    `(covered, end)`: the request stands for the log's last `covered` items, and
    `request[end:]` is new. (0, 0) when the request does not hold the log's last item (a
    client sending only its new messages): all of it is new, the whole log is history.
    Walking back from that item, a request item the log skipped as a duplicate (one seen
    earlier in the request: `session_events_append`'s window) is passed over, so "continue"
    said twice does not hide the rest. A request that runs out first (a client keeping a
    shorter window, or sending an answered tool call again) stands for what it matched: the
    older log is history. One that parts from the log before it runs out carries its own
    version of the conversation (edited, regenerated, retried): it stands for the whole log,
    which is then not replayed, or the upstream would see the conversation twice."""
    if not log or not request:
        return 0, 0
    first_at: dict[str, int] = {}
    for at, digest in enumerate(request):
        first_at.setdefault(digest, at)
    anchors = [at for at in range(len(request) - 1, -1, -1) if request[at] == log[-1]][:_OVERLAP_ANCHORS]
    best: tuple[int, bool, int] = (0, False, 0)  # matched, parted, anchor
    for anchor in anchors:
        matched, at, parted = 0, anchor, False
        while at >= 0 and matched < len(log):
            digest = request[at]
            if digest == log[-1 - matched]:
                matched += 1
            elif first_at[digest] >= at:
                parted = True  # an item the log would hold: the two conversations differ here
                break
            at -= 1
        if matched > best[0]:
            best = (matched, parted, anchor)
        if matched == len(log):
            break
    matched, parted, anchor = best
    if not matched:
        return 0, 0
    return (len(log) if parted else matched), anchor + 1


def messages_enrich(
    messages: list[dict[str, Any]], *, memory_block: str | None, history: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """[system + memory block] [history] [the request's other messages] (seed 004). The
    request's leading instructions (its first messages with a system or developer role,
    the newer name of the same thing) are the "system" part: the memory block is appended
    to the first of them, the history goes after the last. A request that does not start
    with one gets the memory block as its own system message first; a system message
    further down stays where the client put it."""
    enriched = [dict(m) for m in messages]
    leading = 0
    while leading < len(enriched) and enriched[leading].get("role") in SYSTEM_ROLES:
        leading += 1
    if memory_block:
        if not leading:
            enriched.insert(0, {"role": "system", "content": memory_block})
            leading = 1
        else:
            system = enriched[0]
            content = system.get("content")
            if isinstance(content, list):
                system["content"] = [*content, {"type": "text", "text": memory_block}]
            else:
                system["content"] = f"{content}\n\n{memory_block}" if content else memory_block
    insert_at = leading
    rest = enriched[insert_at:]
    return [*enriched[:insert_at], *_answered_tool_calls_only(history, then=rest), *rest]


def _answered_tool_calls_only(history: list[dict[str, Any]], *, then: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as OpenAI accepts it: an assistant message's tool calls each followed
    by their tool message (else a 400 for the whole request). The log can hold a call
    without its output: the output only comes with the next request (which may send it
    right after the history: `then`), and a stream stopped mid tool call stores the call
    alone. Unanswered calls are left out (the message's text stays), and so are tool
    messages that answer no call right before them."""
    sequence = [*history, *then]
    out: list[dict[str, Any]] = []
    open_calls: set[str] = set()
    for at, message in enumerate(history):
        if message.get("role") == "tool":
            if message.get("tool_call_id") in open_calls:
                out.append(message)
            continue
        open_calls = set()
        calls = message.get("tool_calls")
        if calls:
            answered = _tool_answers(sequence, start=at + 1)
            kept = [call for call in calls if call.get("id") in answered]
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            if kept:
                message["tool_calls"] = kept
                open_calls = {call["id"] for call in kept}
            elif not message.get("content"):
                continue
        out.append(message)
    return out


def _tool_answers(sequence: list[dict[str, Any]], *, start: int) -> set[Any]:
    answered: set[Any] = set()
    for message in sequence[start:]:
        if message.get("role") != "tool":
            break
        answered.add(message.get("tool_call_id"))
    return answered


# --- the answer, collected on the side -------------------------------------------------
MAX_TOOL_CALLS = 1000
# One pass finds the first of them (no two start alike), so an event costs its own bytes.
_SSE_SEPARATOR = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_SEPARATOR_MAX = 4
# One event is a chunk of a chat answer, a few hundred bytes: an upstream (a key's owner
# may pick their own) sending megabytes without a blank line is not streaming an answer.
MAX_EVENT_BYTES = 1024 * 1024
DEFAULT_MAX_ANSWER_BYTES = 16 * 1024 * 1024


def storable(value: Any) -> str:
    """Upstream text as we store it: a string, NUL and lone surrogates replaced (the
    database refuses them; the client still gets the upstream's bytes unchanged)."""
    return _UNSTORABLE.sub("\ufffd", value) if isinstance(value, str) else ""


def completion_message(raw: bytes) -> dict[str, Any]:
    """choices[0].message of a non-streaming 200 answer; 502 `upstream_error` if the body
    is not a chat completion (not JSON, no choices, a message or tool call of the wrong
    shape): relaying it as a success would store and bill half a turn."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise upstream_error("The upstream LLM answered with something that is not JSON.") from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise upstream_error("The upstream LLM's answer has no choices.")
    message = choices[0].get("message")
    if not isinstance(message, dict):
        raise upstream_error("The upstream LLM's answer has no message.")
    content, tool_calls = message.get("content"), message.get("tool_calls")
    if content is not None and not isinstance(content, str | list):
        raise upstream_error("The upstream LLM's message content is neither text nor a list of parts.")
    if tool_calls is not None and (
        not isinstance(tool_calls, list)
        or not all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in tool_calls)
    ):
        raise upstream_error("The upstream LLM's tool calls are not objects with a function.")
    return message


@dataclass
class Answer:
    content: str = ""
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    # A stream is whole once it said so: `data: [DONE]`, or a finish_reason before a
    # clean close (some upstreams omit [DONE]). Anything else was cut off.
    done: bool = False
    finished: bool = False
    # The upstream reported an error inside its stream (OpenAI sends `data: {"error":...}`).
    errored: bool = False
    # The most answer a stream may collect (PROXY_MAX_ANSWER_BYTES): its text and tool
    # calls, what this holds until the turn is stored; past it, `feed` raises. Counted in
    # characters; a stream's framing (and logprobs, ~2 KB a token) is relayed, not held.
    max_bytes: int = DEFAULT_MAX_ANSWER_BYTES
    collected: int = 0
    _buffer: bytearray = field(default_factory=bytearray)
    _content_parts: list[str] = field(default_factory=list)

    def as_message(self) -> dict[str, Any] | None:
        self._content_join()
        calls = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        if not self.content and not calls:
            return None
        message: dict[str, Any] = {"role": "assistant", "content": storable(self.content) or None}
        if calls:
            message["tool_calls"] = [
                {
                    "id": storable(call["id"]),
                    "type": "function",
                    "function": {name: storable(call["function"][name]) for name in ("name", "arguments")},
                }
                for call in calls
            ]
        return message

    def take_message(self, message: dict[str, Any]) -> None:
        """A non-streaming answer's choices[0].message, as `completion_message` checked it
        (reasoning_content ignored)."""
        self.content = text_of(message.get("content"))
        for index, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function") or {}
            self.tool_calls[index] = {
                "id": _text(call.get("id")),
                "type": "function",
                "function": {"name": _text(function.get("name")), "arguments": _text(function.get("arguments"))},
            }
        self.done = self.finished = True

    def feed(self, data: bytes) -> bytes:
        """SSE bytes as they arrive; returns the complete events among them (separators
        included) for relaying, so a stream cut off mid-event is never relayed half an
        event, and the error event we end it with stays parseable.
        Linear in the bytes received: only the new bytes (and a separator's length before
        them) are searched. 502 `upstream_answer_too_large` past `max_bytes` of answer or
        an event over MAX_EVENT_BYTES: this runs on the event loop, and holds what it reads."""
        start = max(0, len(self._buffer) - (_SEPARATOR_MAX - 1))
        self._buffer += data
        out: list[bytes] = []
        while (cut := _event_end(self._buffer, start)) is not None:
            event = bytes(self._buffer[: cut[0]])
            out.append(bytes(self._buffer[: cut[1]]))  # with the separator, as the upstream sent it
            del self._buffer[: cut[1]]
            start = 0
            self._event(event)
        if self.collected > self.max_bytes:
            raise upstream_answer_too_large(
                f"The upstream LLM's answer exceeds {self.max_bytes} characters; it was cut off."
            )
        if len(self._buffer) > MAX_EVENT_BYTES:
            raise upstream_answer_too_large(
                f"The upstream LLM sent an event over {MAX_EVENT_BYTES} bytes; the stream was cut off."
            )
        return b"".join(out)

    def close(self) -> bytes:
        """At a clean end of the stream: the bytes after the last separator, read as one
        last event (a stream may end `data: [DONE]\n` without the blank line)."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        if rest.strip():
            self._event(rest)
        return rest

    @property
    def complete(self) -> bool:
        return self.done or self.finished

    def _event(self, event: bytes) -> None:
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                continue
            if not data:
                continue
            try:
                chunk = json.loads(data)
            except (ValueError, RecursionError):
                continue
            if not isinstance(chunk, dict):
                continue
            if chunk.get("error"):
                self.errored = True
                continue
            choices = chunk.get("choices")
            if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
                continue  # e.g. Azure's prompt_filter_results chunk
            # With n > 1 the choices' chunks interleave: the stored answer is choice 0's.
            first = next((c for c in choices if isinstance(c, dict) and c.get("index", 0) in (0, None)), None)
            if first is None:
                continue
            if first.get("finish_reason"):
                self.finished = True
            delta = first.get("delta")
            if isinstance(delta, dict):
                self._delta(delta)

    def _content_join(self) -> None:
        if self._content_parts:
            self.content += "".join(self._content_parts)
            self._content_parts.clear()

    def _delta(self, delta: dict[str, Any]) -> None:
        if isinstance(delta.get("content"), str):
            # Joined once at the end: `+=` on an attribute copies the whole text each time.
            self._content_parts.append(delta["content"])
            self.collected += len(delta["content"])
        tool_calls = delta.get("tool_calls")
        for call in tool_calls if isinstance(tool_calls, list) else []:
            if not isinstance(call, dict):
                continue
            index = call.get("index", 0)
            if index is None:
                index = 0
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_TOOL_CALLS:
                continue  # a piece we cannot place: leave it out of the stored turn
            empty = {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            slot = self.tool_calls.setdefault(index, empty)
            if isinstance(call.get("id"), str) and call["id"]:
                slot["id"] = call["id"]
            function = call.get("function")
            if isinstance(function, dict):
                name, arguments = _text(function.get("name")), _text(function.get("arguments"))
                slot["function"]["name"] += name
                slot["function"]["arguments"] += arguments
                self.collected += len(name) + len(arguments)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _event_end(buffer: bytearray, start: int = 0) -> tuple[int, int] | None:
    found = _SSE_SEPARATOR.search(buffer, start)
    return (found.start(), found.end()) if found else None
