"""Checks every surface runs on untrusted input before anything else sees it: JSON parsed
without recursion or non-finite numbers, and decoded values walked for invalid code
points, non-finite floats and excessive nesting.

Postgres refuses NUL (text and jsonb) and lone surrogates (UTF-8), and a JSON body nested
100,000 deep makes Python's parser raise RecursionError: input like that must be a coded
400 at the edge, never a 500 or a "retry later" from the database.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection
from typing import Any

MAX_JSON_DEPTH = 32
MAX_JSON_NODES = 20_000
MAX_INT_DIGITS = 100
# The smallest magnitude with more than MAX_INT_DIGITS digits: a size check without
# str() of a huge int (quadratic, and refused past 4300 digits by Python itself).
_INT_TOO_LARGE = 10**MAX_INT_DIGITS

# C0 controls except tab, line feed and carriage return, and UTF-16 surrogates (which a
# JSON "\ud800" escape decodes to but no UTF-8 text can hold).
_INVALID_TEXT = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff]")
# What Postgres cannot store at all: NUL (text and jsonb) and lone surrogates (not UTF-8).
_UNSTORABLE_TEXT = re.compile(r"[\x00\ud800-\udfff]")
# A JSON string (skipped) or a bracket (counted). An unterminated string runs to the end of
# the text (the JSON is invalid anyway): required to close, it made every later quote start
# another scan to the end, quadratic in a body of escaped quotes.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]+|\\.)*"?|[\[\]{}]', re.DOTALL)


_ASCII_DIGITS = re.compile(r"[0-9]+")


def digits_int(text: str, *, max_digits: int = 18) -> int | None:
    """The number `text` spells in ASCII digits only, at most `max_digits` of them (18 fit
    a bigint); None for anything else. `str.isdigit()` is no such check: it is true for
    "²", which int() refuses, and for other scripts' digits, which int() reads."""
    if len(text) > max_digits or not _ASCII_DIGITS.fullmatch(text):
        return None
    return int(text)


def text_storable(value: str) -> str:
    """`value` with every character Postgres refuses or a log line should not carry (NUL,
    C0 controls, lone surrogates) replaced by U+FFFD. For request metadata kept as it
    came (headers: a user agent, a turn id, a subject claim), which no call fails over:
    a claim so changed names nobody, and the audit row still records the call."""
    return _INVALID_TEXT.sub("\ufffd", value)


class InputError(ValueError):
    """Input no surface may pass on. `too_large` tells 413 from 400. Messages name the
    problem and where it is, never the offending content."""

    def __init__(self, message: str, *, too_large: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.too_large = too_large


# The words for a lone surrogate wherever one is refused (here, and the MCP gate's check of
# a whole JSON-RPC message), so every surface names it alike.
LONE_SURROGATE_PROBLEM = "contains an invalid code point (a lone surrogate)"


def text_problem(value: str) -> str | None:
    """Why `value` cannot be stored or searched as text, or None."""
    match = _INVALID_TEXT.search(value)
    if match is None:
        return None
    code = ord(match.group())
    if code == 0:
        return "contains a NUL character"
    if 0xD800 <= code <= 0xDFFF:
        return LONE_SURROGATE_PROBLEM
    return f"contains the control character U+{code:04X}"


def transcript_text_problem(value: str) -> str | None:
    """Why `value` cannot be kept in a session log (JSONB), or None: only NUL and lone
    surrogates. For conversation items stored as they came (the turn's input and output
    items): tool outputs carry terminal escapes and form feeds, which JSONB stores as
    they are, and the chat proxy keeps them too. Memory texts, ids and metadata keep
    `text_problem`'s full check."""
    match = _UNSTORABLE_TEXT.search(value)
    if match is None:
        return None
    if match.group() == "\x00":
        return "contains a NUL character"
    return LONE_SURROGATE_PROBLEM


_TextCheck = Callable[[str], str | None]


def _where(path: tuple[str | int, ...]) -> str:
    return ".".join(str(p) for p in path) or "arguments"


def json_value_check(
    value: Any,
    *,
    max_depth: int = MAX_JSON_DEPTH,
    max_nodes: int = MAX_JSON_NODES,
    transcript_keys: Collection[str] = (),
) -> None:
    """Raise InputError if a decoded JSON value (dicts, lists, scalars) holds an invalid
    string (values and keys), a non-finite number, an integer of more than 100 digits (what
    `json_loads_safe` refuses: a surface whose parser is not ours, MCP, gets the same
    limit), or is nested or sized past the limits. Iterative, so no input can exhaust the
    stack. `transcript_keys`: top-level keys whose values are conversation items, their
    strings held to `transcript_text_problem` only."""
    stack: list[tuple[Any, tuple[str | int, ...], _TextCheck]] = [(value, (), text_problem)]
    nodes = 0
    while stack:
        item, path, problem_of = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise InputError(f"the input has more than {max_nodes} values", too_large=True)
        if len(path) > max_depth:
            raise InputError(f"{_where(path[:max_depth])}: nested deeper than {max_depth} levels")
        if isinstance(item, str):
            problem = problem_of(item)
            if problem:
                raise InputError(f"{_where(path)}: {problem}")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise InputError(f"{_where(path)}: numbers must be finite (no NaN or Infinity)")
        elif isinstance(item, int) and not isinstance(item, bool):
            if abs(item) >= _INT_TOO_LARGE:
                raise InputError(f"{_where(path)}: integers may have at most {MAX_INT_DIGITS} digits")
        elif isinstance(item, dict):
            for n, (key, child) in enumerate(item.items(), start=1):
                if not isinstance(key, str):
                    raise InputError(f"{_where(path)}: object keys must be strings")
                problem = problem_of(key)
                if problem:
                    raise InputError(f"{_where(path)}: a key {problem}")
                # Top-level keys are argument names (ours); a nested object's keys are the
                # caller's own text (metadata may hold anything, a secret too): by position.
                child_check = transcript_text_problem if not path and key in transcript_keys else problem_of
                stack.append((child, (*path, key[:64] if not path else f"#{n}"), child_check))
        elif isinstance(item, list | tuple):
            stack.extend((child, (*path, index), problem_of) for index, child in enumerate(item))


def _reject_constant(name: str) -> Any:  # noqa: ARG001 - json's parse_constant signature
    raise InputError("numbers must be finite (no NaN or Infinity)")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):  # 1e400
        raise InputError("numbers must be finite and within double range")
    return number


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise InputError(f"integers may have at most {MAX_INT_DIGITS} digits")
    return int(text)


def json_depth_check(text: str, *, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Count nesting without parsing (a regex over strings and brackets), so a body
    nested 100,000 deep is refused before the recursive parser sees it."""
    depth = 0
    for token in _JSON_TOKENS.finditer(text):
        char = token.group()
        if char in "[{":
            depth += 1
            if depth > max_depth:
                raise InputError(f"JSON nested deeper than {max_depth} levels")
        elif char in "]}":
            depth -= 1


def json_loads_safe(data: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads for untrusted input: UTF-8 only, bounded depth, finite numbers only,
    and every string and key free of invalid code points. Raises InputError."""
    if isinstance(data, bytes | bytearray):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            raise InputError("the body is not valid UTF-8") from None
    else:
        text = data
    json_depth_check(text, max_depth=max_depth)
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float, parse_int=_bounded_int)
    except InputError:
        raise
    except (ValueError, RecursionError) as exc:
        detail = f" (line {exc.lineno}, column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise InputError(f"not valid JSON{detail}") from None
    json_value_check(value, max_depth=max_depth)
    return value
