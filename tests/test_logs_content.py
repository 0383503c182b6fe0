"""Issue 10, acceptance 5: memory content never reaches a log. A realistic mix of calls,
successful and failing (bad input, missing ids, an unexpected failure whose exception
quotes the text, like psycopg's `CONTEXT: JSON data ...`), with distinctive texts; then
none of them may appear in the test process's output and log records, nor in the live
server's output."""

from __future__ import annotations

import logging
import uuid

import pytest

from core.log_safety import ContentSafeFilter
from memories import services

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("clean_vectors", "no_broker_backlog"),
]

# Distinctive enough that any occurrence in a log is a leak.
SECRETS = {
    "remembered": "Zanzibar-quokka-7731 lives at the lighthouse",
    "updated": "Zanzibar-marmot-8842 moved to the mill",
    "metadata": "Zanzibar-okapi-9953",
    "ingested": "Zanzibar-tapir-1164 adopted a heron",
    "fact": "Zanzibar-narwhal-2275 is the user's cat",
    "nul": "Zanzibar-axolotl-3386",
    "missing": "Zanzibar-pangolin-4497",
    "crash": "Zanzibar-caracal-5508",
    "query": "Zanzibar-ibex-6619",
}
# What must never appear: the distinctive word of each (texts may be split or escaped).
MARKERS = [text.split()[0] for text in SECRETS.values()]


def test_no_memory_content_in_any_log(
    mcp_as, alice_key, api_client, memsite_server_process, fake_llm, caplog, capfd, monkeypatch
):
    live_log = memsite_server_process["log"]
    live_offset = live_log.stat().st_size
    caplog.set_level(logging.DEBUG)  # every record reaches the handlers
    mcp = mcp_as(alice_key)
    rest = api_client(alice_key)

    # Successful calls: remember (twice: dedupe), search, list with a filter, update, ingest, delete.
    memory_id = mcp.ok("remember", {"memory": SECRETS["remembered"], "metadata": {"note": SECRETS["metadata"]}})["id"]
    assert mcp.ok("remember", {"memory": SECRETS["remembered"]})["duplicate"] is True
    assert mcp.ok("search_memory", {"query": SECRETS["query"]})["results"]
    listed = mcp.ok("list_memory", {"filters": {"note": SECRETS["metadata"]}})["memories"]
    assert [m["id"] for m in listed] == [memory_id]
    mcp.ok("update_memory", {"memory_id": memory_id, "memory": SECRETS["updated"]})
    fake_llm.queue_facts(SECRETS["fact"])
    mcp.ok("ingest", {"messages": [{"role": "user", "content": SECRETS["ingested"]}]})
    # The same over the live server's REST API (its access log sees the query string).
    live = memsite_server_process["url"]
    import urllib.parse
    import urllib.request

    query = urllib.parse.urlencode({"filters": f'{{"note": "{SECRETS["metadata"]}"}}'})
    request = urllib.request.Request(f"{live}/v1/memories?{query}", headers={"Authorization": f"Bearer {alice_key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200

    # Failing calls.
    assert mcp.error("remember", {"memory": SECRETS["nul"] + "\u0000"})["code"] == "invalid_argument"
    assert mcp.error("search_memory", {"query": SECRETS["query"] + "\u0000"})["code"] == "invalid_argument"
    missing = {"memory_id": str(uuid.uuid4()), "memory": SECRETS["missing"]}
    assert mcp.error("update_memory", missing)["code"] == "not_found"
    assert rest.post("/v1/memories", {"memory": SECRETS["nul"] + "\u0000"}, format="json").status_code == 400
    assert rest.post("/v1/memories/search", {"query": "x" * 2001}, format="json").status_code == 413

    # An unexpected failure whose exception quotes the memory (as psycopg's CONTEXT does):
    # Django logs the 500 with its traceback, which must not carry the message.
    def crash(text, *args, **kwargs):
        raise RuntimeError(f'CONTEXT:  JSON data, line 1: {{"data": "{text}"')

    monkeypatch.setattr(services, "engine_embed_text", crash)
    rest.raise_request_exception = False
    assert rest.post("/v1/memories", {"memory": SECRETS["crash"]}, format="json").status_code == 500
    monkeypatch.undo()

    mcp.ok("delete_memory", {"memory_id": memory_id})

    captured = capfd.readouterr()
    # What the process's console handler prints: every record through its own filters.
    console = next(h for h in logging.getLogger().handlers if any(isinstance(f, ContentSafeFilter) for f in h.filters))
    printed = captured.out + captured.err
    for record in caplog.records:
        copy = logging.makeLogRecord(record.__dict__)
        if all(f.filter(copy) for f in console.filters):
            printed += console.format(copy) + "\n"
    live_output = live_log.read_bytes()[live_offset:].decode(errors="replace")
    assert "Internal Server Error" in printed  # the 500 was logged, only without content
    assert "message withheld" in printed
    assert "/v1/memories?" in live_output  # the access log saw the request, not its query
    for where, text in {"test process": printed, "live server": live_output}.items():
        leaked = [marker for marker in MARKERS if marker in text]
        assert not leaked, f"{where} leaked {leaked}"
