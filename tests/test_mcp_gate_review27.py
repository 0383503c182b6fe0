"""Review 27, the MCP endpoint's JSON-RPC gate (`McpHttpGate`): a lone surrogate (a
JavaScript client's truncated emoji, escaped by JSON.stringify) is an answered refusal, not
the SDK's parse error with id null; a request without an id is refused, not taken for a
notification and dropped; a malformed response or error envelope is refused without the
SDK's pydantic dump of the client's data. In-process, as tests/test_mcp_review19.py."""

from __future__ import annotations

import json

import pytest

from audit.models import AuditEvent
from billing.models import UsageEvent
from memories.models import EngineMemoryRow
from memories.services import api_key_issue
from tests.test_mcp_review19 import LEGACY, MEMORY, MODERN, TOOLKIT, _assert_refusal, _auth, _post, _serve

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

SURROGATE = "\\ud83d"  # the 6-character JSON escape, written as is into the body's bytes
SURROGATE_PROBLEM = "contains an invalid code point (a lone surrogate)"
# MCP 2026-07-28: the per-request envelope and its routing headers.
MODERN_META = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientCapabilities": {},
}


def _raw_call(name: str, arguments: str, request_id: str = "7", meta: dict | None = None) -> bytes:
    """A tools/call whose arguments (and id) are JSON text as given, escapes and all."""
    params = f'"name": "{name}", "arguments": {arguments}'
    if meta is not None:
        params += f', "_meta": {json.dumps(meta)}'
    return f'{{"jsonrpc": "2.0", "id": {request_id}, "method": "tools/call", "params": {{{params}}}}}'.encode()


def _nothing_done() -> bool:
    return not EngineMemoryRow.objects.exists() and not UsageEvent.objects.exists()


# --- 1: lone surrogates -----------------------------------------------------------------------
IN_ARGUMENTS = [
    ("value", MEMORY, "remember", f'{{"memory": "smile {SURROGATE}"}}', f"memory: {SURROGATE_PROBLEM}"),
    (
        "metadata key",
        MEMORY,
        "remember",
        f'{{"memory": "ok", "metadata": {{"mood {SURROGATE}": "smile"}}}}',
        f"metadata: a key {SURROGATE_PROBLEM}",
    ),
    ("toolkit", TOOLKIT, "store_cache", f'{{"query": "smile {SURROGATE}", "response": "r"}}', None),
]


@pytest.mark.parametrize(
    ("label", "path", "tool", "arguments", "message"), IN_ARGUMENTS, ids=[c[0] for c in IN_ARGUMENTS]
)
def test_a_lone_surrogate_in_a_tools_arguments_is_its_coded_tool_error(alice, label, path, tool, arguments, message):  # noqa: ARG001
    token = api_key_issue(user=alice, name="agent")[1]

    async def work(http):
        return await _post(http, path, _raw_call(tool, arguments), _auth(token))

    response = _serve(work)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["id"] == 7, answer
    result = answer["result"]
    assert result["isError"] is True and "structuredContent" not in result, result
    error = json.loads(result["content"][0]["text"])
    if path == TOOLKIT:  # seed 003's flat shape
        code, text = error["code"], error["error"]
        assert text.startswith("query: ") and SURROGATE_PROBLEM in text, error
    else:
        code, text = error["error"]["code"], error["error"]["message"]
        assert text == message, error
    assert code == "invalid_argument"
    assert "smile" not in response.text  # never the content
    # Audited as any refused call, not billed, nothing stored.
    row = AuditEvent.objects.get(channel="mcp")
    assert (row.channel, row.outcome, row.error_code) == ("mcp", "error", "invalid_argument")
    assert _nothing_done()


def test_a_lone_surrogate_in_the_arguments_of_a_modern_era_call_is_its_tool_error(alice):
    token = api_key_issue(user=alice, name="agent")[1]
    headers = {"Authorization": f"Bearer {token}", **MODERN, "Mcp-Method": "tools/call", "Mcp-Name": "remember"}

    async def work(http):
        body = _raw_call("remember", f'{{"memory": "smile {SURROGATE}"}}', meta=MODERN_META)
        return await _post(http, MEMORY, body, headers)

    response = _serve(work)
    assert response.status_code == 200, response.text
    assert response.json()["id"] == 7 and response.json()["result"]["isError"] is True
    error = json.loads(response.json()["result"]["content"][0]["text"])["error"]
    assert error == {"code": "invalid_argument", "message": f"memory: {SURROGATE_PROBLEM}"}
    assert AuditEvent.objects.get(channel="mcp").error_code == "invalid_argument" and _nothing_done()


OUTSIDE_ARGUMENTS = {
    "tool name": (_raw_call(f"remember{SURROGATE}", '{"memory": "smile"}'), 7, f"params.name: {SURROGATE_PROBLEM}"),
    "id": (
        _raw_call("remember", '{"memory": "smile"}', request_id=f'"a{SURROGATE}"'),
        None,
        f"id: {SURROGATE_PROBLEM}",
    ),
    "method": (
        f'{{"jsonrpc": "2.0", "id": "x", "method": "tools/list{SURROGATE}"}}'.encode(),
        "x",
        f"method: {SURROGATE_PROBLEM}",
    ),
    "params key": (
        f'{{"jsonrpc": "2.0", "id": 3, "method": "tools/list", "params": {{"c{SURROGATE}": 1}}}}'.encode(),
        3,
        f"params: a key {SURROGATE_PROBLEM}",
    ),
    "arguments not an object": (
        _raw_call("remember", f'["smile {SURROGATE}"]'),
        7,
        f"params.arguments.0: {SURROGATE_PROBLEM}",
    ),
    "a notification": (
        f'{{"jsonrpc": "2.0", "method": "notifications/initialized", "params": {{"x": "{SURROGATE}"}}}}'.encode(),
        None,
        f"params.x: {SURROGATE_PROBLEM}",
    ),
}


@pytest.mark.parametrize("era", ["legacy", "modern"])
def test_a_lone_surrogate_outside_a_tools_arguments_is_refused_with_the_requests_id(alice, era):
    token = api_key_issue(user=alice, name="agent")[1]
    headers = {"Authorization": f"Bearer {token}", **(LEGACY if era == "legacy" else MODERN)}

    async def work(http):
        return {label: await _post(http, MEMORY, body, headers) for label, (body, _, _) in OUTSIDE_ARGUMENTS.items()}

    answers = _serve(work)
    for label, (_, request_id, message) in OUTSIDE_ARGUMENTS.items():
        response = answers[label]
        assert response.status_code == 400, (label, response.text)
        answer = response.json()
        assert answer["jsonrpc"] == "2.0" and answer["id"] == request_id, (label, answer)
        assert answer["error"]["code"] == -32600, (label, answer)
        assert answer["error"]["data"] == {"code": "invalid_argument", "message": message}, (label, answer)
        assert answer["error"]["message"] == message
        assert "smile" not in response.text and "Parse error" not in response.text
    assert not AuditEvent.objects.filter(channel="mcp").exists() and _nothing_done()


# --- 2: a request without an id ---------------------------------------------------------------
NO_ID_REQUESTS = {
    "clear all": {
        "jsonrpc": "2.0",
        "method": "tools/call",
        "params": {"name": "clear_all_memory", "arguments": {"confirm": True}},
    },
    "remember": {
        "jsonrpc": "2.0",
        "method": "tools/call",
        "params": {"name": "remember", "arguments": {"memory": "x"}},
    },
    "tools/list": {"jsonrpc": "2.0", "method": "tools/list"},
}


@pytest.mark.parametrize("era", ["legacy", "modern"])
def test_a_request_without_an_id_is_refused_not_dropped(alice, era):
    token = api_key_issue(user=alice, name="agent")[1]
    headers = {"Authorization": f"Bearer {token}", **(LEGACY if era == "legacy" else MODERN)}

    async def work(http):
        answers = {label: await _post(http, MEMORY, body, headers) for label, body in NO_ID_REQUESTS.items()}
        notification = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        return answers, await _post(http, MEMORY, notification, headers)

    answers, notification = _serve(work)
    for label, response in answers.items():
        error = _assert_refusal(response, 400, "invalid_argument")
        assert error["message"].startswith("A JSON-RPC request needs an id"), (label, error)
    assert notification.status_code == 202, notification.text  # a notification is still one
    assert not AuditEvent.objects.filter(channel="mcp").exists() and _nothing_done()


# --- 3: malformed responses and errors --------------------------------------------------------
MALFORMED_RESPONSES = {
    "error a string": {"jsonrpc": "2.0", "id": 1, "error": "x"},
    "error without an id": {"jsonrpc": "2.0", "error": {"code": 1, "message": "m"}},
    "result without an id": {"jsonrpc": "2.0", "result": {}},
    "result a list": {"jsonrpc": "2.0", "id": 1, "result": [1]},
    "result and error": {"jsonrpc": "2.0", "id": 1, "result": {}, "error": {"code": 1, "message": "m"}},
    "error code a string": {"jsonrpc": "2.0", "id": 1, "error": {"code": "1", "message": "m"}},
    "error code a bool": {"jsonrpc": "2.0", "id": 1, "error": {"code": True, "message": "m"}},
    "error code a float": {"jsonrpc": "2.0", "id": 1, "error": {"code": 1.5, "message": "m"}},
    "error without a message": {"jsonrpc": "2.0", "id": 1, "error": {"code": 1, "data": {"secret": "hunter2"}}},
    "error message not text": {"jsonrpc": "2.0", "id": 1, "error": {"code": 1, "message": {"secret": "hunter2"}}},
}


def test_a_malformed_response_or_error_is_refused_without_a_dump_of_it(alice):
    token = api_key_issue(user=alice, name="agent")[1]
    well_formed = [
        {"jsonrpc": "2.0", "id": 1, "result": {}},
        {"jsonrpc": "2.0", "id": "s", "error": {"code": -1, "message": "m", "data": [1]}},
    ]

    async def work(http):
        answers = {label: await _post(http, MEMORY, body, _auth(token)) for label, body in MALFORMED_RESPONSES.items()}
        return answers, [await _post(http, MEMORY, body, _auth(token)) for body in well_formed]

    answers, passed = _serve(work)
    for label, response in answers.items():
        error = _assert_refusal(response, 400, "invalid_argument", request_id=MALFORMED_RESPONSES[label].get("id"))
        assert error["message"].startswith("A JSON-RPC "), (label, error)
        assert "hunter2" not in response.text and "errors.pydantic.dev" not in response.text, label
    # Well-formed answers to a server request go on to the SDK (a stateless server sends
    # none, so it acknowledges and drops them).
    assert [response.status_code for response in passed] == [202, 202]


# --- 4: every 400 refusal carries the request's id --------------------------------------------
# A client matches answers to calls by id: a refusal of a message whose id can be read names
# it, whatever the reason; an id that is itself not a valid JSON-RPC id answers null.
REFUSED_WITH_ID = {
    "jsonrpc 1.0": ({"jsonrpc": "1.0", "id": 5, "method": "tools/list"}, 5),
    "no jsonrpc": ({"id": "a", "method": "tools/list"}, "a"),
    "method a number": ({"jsonrpc": "2.0", "id": 6, "method": 1}, 6),
    "params a list": ({"jsonrpc": "2.0", "id": "p", "method": "tools/list", "params": [1]}, "p"),
    "no method": ({"jsonrpc": "2.0", "id": 8}, 8),
    "error a string": ({"jsonrpc": "2.0", "id": 1, "error": "x"}, 1),
    "result a list": ({"jsonrpc": "2.0", "id": "r", "result": [1]}, "r"),
    "result and error": ({"jsonrpc": "2.0", "id": 2, "result": {}, "error": {"code": 1, "message": "m"}}, 2),
    "id a float": ({"jsonrpc": "2.0", "id": 1.5, "method": "tools/list"}, None),
    "id a bool": ({"jsonrpc": "2.0", "id": True, "method": "tools/list"}, None),
    "id an object": ({"jsonrpc": "2.0", "id": {"n": 1}, "method": "tools/list"}, None),
    "a batch": ([{"jsonrpc": "2.0", "id": 9, "method": "tools/list"}], None),
    "no id": ({"jsonrpc": "2.0", "method": "tools/list"}, None),
    "bad id, bad version": ({"jsonrpc": "1.0", "id": False, "method": "tools/list"}, None),
    "surrogate id, bad version": (f'{{"jsonrpc": "1.0", "id": "a{SURROGATE}", "method": "tools/list"}}'.encode(), None),
}


@pytest.mark.parametrize("era", ["legacy", "modern"])
def test_every_400_refusal_carries_the_requests_id_when_it_is_valid(alice, era):
    token = api_key_issue(user=alice, name="agent")[1]
    headers = {"Authorization": f"Bearer {token}", **(LEGACY if era == "legacy" else MODERN)}

    async def work(http):
        return {label: await _post(http, MEMORY, body, headers) for label, (body, _) in REFUSED_WITH_ID.items()}

    answers = _serve(work)
    for label, (_, request_id) in REFUSED_WITH_ID.items():
        response = answers[label]
        assert response.status_code == 400, (label, response.text)
        answer = response.json()
        assert answer["jsonrpc"] == "2.0" and answer["id"] == request_id, (label, answer)
        assert type(answer["id"]) is type(request_id), (label, answer)  # 1, never True
        assert answer["error"]["code"] == -32600 and answer["error"]["data"]["code"] == "invalid_argument", label
    assert not AuditEvent.objects.filter(channel="mcp").exists() and _nothing_done()
