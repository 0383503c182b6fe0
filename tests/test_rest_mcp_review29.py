"""Agent-facing contract faults found by session 29's review of REST and MCP:
- the seven-tool `delete_memory` with a memory_id and `dry_run: true` really deleted (and
  billed a delete); it now counts, changes nothing, as its bulk form and the toolkit's do;
- a prefetch of blank messages was billed with nothing to recall for (a blank query is a
  400); now it is refused the same way, unbilled;
- the OpenAPI schema listed no 403 (a read-only key writing) nor the subject's 404 on
  the /v1/memories routes."""

from __future__ import annotations

import pytest

from billing.models import UsageEvent
from core.errors import ErrorCode, ServiceError
from memories.auth import Principal
from memories.operations import operation_execute
from memories.services import api_key_issue
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def run(user, name: str, **arguments) -> dict:
    principal = Principal(user=user, method="api_key", client_app="review29-agent")
    return operation_execute(principal, name, arguments, call=internal_call())


def _listed(user) -> list[str]:
    return [m["id"] for m in run(user, "list_memory")["memories"]]


def test_delete_memory_by_id_with_dry_run_counts_and_changes_nothing(alice, bob):
    memory_id = run(alice, "remember", memory="Alice's locker code is 7781")["id"]
    events = UsageEvent.objects.count()

    answer = run(alice, "delete_memory", memory_id=memory_id, dry_run=True)

    assert answer == {"id": memory_id, "deleted": False, "deleted_count": 1, "dry_run": True}
    assert UsageEvent.objects.count() == events + 1  # a billed, audited count, as the bulk dry run
    assert _listed(alice) == [memory_id]  # still there, not in the trash
    events = UsageEvent.objects.count()
    for user, wrong in ((bob, memory_id), (alice, "00000000-0000-4000-8000-000000000000")):
        with pytest.raises(ServiceError) as refused:  # another user's id is as missing as an unknown one
            run(user, "delete_memory", memory_id=wrong, dry_run=True)
        assert refused.value.code == ErrorCode.NOT_FOUND
    assert UsageEvent.objects.count() == events  # refusals are not billed
    assert run(alice, "delete_memory", memory_id=memory_id) == {"id": memory_id, "deleted": True}
    assert _listed(alice) == []


def test_a_prefetch_of_blank_messages_is_refused_unbilled_like_a_blank_query(api_client, alice):
    client = api_client(api_key_issue(user=alice, name="k")[1])
    events = UsageEvent.objects.count()
    for body in (
        {"query": "   "},
        {"messages": [{"role": "user", "content": "   "}]},
        {"messages": [{"role": "system", "content": " "}, {"role": "user", "content": "\n"}]},
    ):
        refused = client.post("/v1/memory/prefetch", body, format="json")
        assert refused.status_code == 400, body
        assert refused.json()["error"]["code"] == "invalid_argument"
    assert UsageEvent.objects.count() == events

    run(alice, "remember", memory="Alice's sister lives in Lisbon")
    # A blank user message beside a real one recalls for the real text.
    found = client.post(
        "/v1/memory/prefetch",
        {
            "messages": [
                {"role": "user", "content": " "},
                {"role": "assistant", "content": "Where does your sister live?"},
            ]
        },
        format="json",
    )
    assert found.status_code == 200
    assert "Lisbon" in found.json()["notes"]


def test_the_openapi_schema_lists_the_403_and_404_every_memories_route_can_give(api_client, alice):
    read_only = api_client(api_key_issue(user=alice, name="ro", permissions=frozenset({"read"}))[1])
    refused = read_only.post("/v1/memories", {"memory": "x"}, format="json")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"

    schema = api_client().get("/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    for path, item in schema["paths"].items():
        if not path.startswith(("/v1/memories", "/v1/trash", "/v1/memory")):
            continue
        for method, operation in item.items():
            if method in {"get", "post", "put", "patch", "delete"}:
                assert {"403", "404"} <= set(operation["responses"]), (method, path)
