"""Review 19 (roundtrip): whatever the product stores, its owner's export imports again.

The import refuses a whole file for one bad record, so each memory the product can hold
but the import cannot take makes a user's entire backup unusable. Every test here takes
a real export (memory_export) and imports it (memory_import_file). Also: issuing an API
key leaves an audit row."""

from __future__ import annotations

import json

import pytest
from django.conf import settings
from django.db import connection

from audit.models import AuditEvent
from core.choices import Channel, Operation, Role
from core.errors import ErrorCode, ServiceError
from core.scope import CallContext
from memories.auth import Principal
from memories.operations import operation_execute
from memories.services import api_key_issue, memory_export, memory_import_file, memory_remember, memory_update
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


@pytest.fixture(autouse=True)
def _no_limits(settings):
    settings.RATE_LIMITS = {k: (0, 60) for k in settings.RATE_LIMITS}


def run(user, name, **arguments):
    return operation_execute(Principal(user=user, method="api_key"), name, arguments, call=CallContext(channel="mcp"))


def _export(scope) -> str:
    return memory_export(scope, file_format="jsonl", call=internal_call()).content


def _import(scope, content: str):
    return memory_import_file(scope, data=content.encode(), source="memsite", call=internal_call())


def _records(content: str) -> list[dict]:
    return [json.loads(line) for line in content.splitlines()[1:]]


def _file(records: list[dict]) -> str:
    header = {"format": "memsite.memories", "version": 1, "count": len(records)}
    return "\n".join(json.dumps(r) for r in [header, *records]) + "\n"


def _all(user) -> list[dict]:
    return run(user, "list_memory", page_size=200)["memories"]


def _payload_set(memory_id: str, path: str, value) -> None:
    """Write into a stored row as an older release (or another writer) left it."""
    with connection.cursor() as cursor:
        cursor.execute(
            f'UPDATE "{settings.MEMORY_COLLECTION}" SET payload = jsonb_set(payload, %s, %s::jsonb) WHERE id = %s',  # noqa: S608
            [path, json.dumps(value), memory_id],
        )


def _msg(role, text):
    kind = "input_text" if role == "user" else "output_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


# --- A1: tags ------------------------------------------------------------------------------
def test_a1_a_fact_said_in_many_projects_keeps_within_the_tag_limit_and_round_trips(alice, bob, alice_scope, bob_scope):
    for n in range(21):
        run(
            alice,
            "memory_after_turn",
            project=f"p{n}",
            session_id=f"s{n}",
            turn_id="t1",
            input_items=[_msg("user", "I always use Helix as my editor for work.")],
            output_items=[_msg("assistant", "Noted.")],
        )
    (fact,) = _all(alice)
    # Past TAGS_MAX the fact became user-wide (no project tag: recalled in every project).
    assert len(fact["tags"]) <= 20
    assert set(fact["tags"]) == {"turn-fact", "tier:long_term"}
    assert _import(bob_scope, _export(alice_scope)).imported == 1
    assert _all(bob)[0]["tags"] == fact["tags"]


def test_a1_an_export_holding_more_system_tags_than_a_client_may_set_imports(alice_scope, bob, bob_scope):
    """Rows stored before the cap (or by any writer adding turn/project tags) export more
    than remember's 20 tags: the import takes the system's tags beyond the owner's 20."""
    made = memory_remember(alice_scope, memory="I write Rust at work.", call=internal_call())
    own = [f"mine{n}" for n in range(20)]
    tags = ["turn-fact", "tier:long_term", *(f"project:p{n}" for n in range(25)), *own]
    _payload_set(made.id, "{attrs,tags}", tags)
    exported = _export(alice_scope)
    assert len(_records(exported)[0]["tags"]) == 47
    assert _import(bob_scope, exported).imported == 1
    assert _all(bob)[0]["tags"] == tags
    # Still refused: more of the owner's own tags than remember takes.
    (record,) = _records(exported)
    record["tags"] = [*tags, "one-too-many"]
    with pytest.raises(ServiceError) as refused:
        _import(bob_scope, _file([record | {"text": "Another text."}]))
    assert refused.value.code == ErrorCode.PAYLOAD_TOO_LARGE and "line 2: tags" in refused.value.message


# --- A2: the enrichment's metadata keys -------------------------------------------------------------
def _ltm_candidate(user) -> dict:
    run(user, "store_memory", conversation_id="c1",
        messages=[{"role": "human", "content": "I prefer window seats on long flights to Asia."}])  # fmt: skip
    return next(m for m in _all(user) if m["metadata"].get("tier") == "ltm")


def test_a2_enrichment_after_the_owner_used_every_metadata_key_round_trips(alice, bob, alice_scope, bob_scope):
    from memories.toolkit.services import toolkit_candidates_enrich

    ltm = _ltm_candidate(alice)
    run(alice, "update_memory", memory_id=ltm["id"], metadata={f"k{n}": "v" for n in range(20 - len(ltm["metadata"]))})
    assert toolkit_candidates_enrich(memory_ids=[ltm["id"]]) == 1
    exported = _export(alice_scope)
    record = next(r for r in _records(exported) if r["id"] == ltm["id"])
    assert len(record["metadata"]) == 22 and record["metadata"]["enrichment_status"] == "completed"
    assert _import(bob_scope, exported).imported == 2  # the long-term memory and its short-term copy
    copy = next(m for m in _all(bob) if m["metadata"].get("tier") == "ltm")
    stm_copy = next(m for m in _all(bob) if m["metadata"].get("tier") == "stm")
    # The link to its short-term row follows that row's new id (the pair stays one message).
    assert copy["metadata"] == record["metadata"] | {"stm_id": stm_copy["id"]}
    # Still refused: more keys of the owner's own than remember takes (19 now, besides
    # enrichment_status, summary and enriched_by).
    record["metadata"] |= {"k_extra": "v", "k_extra2": "v"}
    with pytest.raises(ServiceError) as refused:
        _import(bob_scope, _file([record | {"text": "Another long enough text for the check."}]))
    assert refused.value.code == ErrorCode.PAYLOAD_TOO_LARGE and "at most 20 keys" in refused.value.message


def test_a2_failed_enrichment_attempts_do_not_block_the_import(alice, bob, alice_scope, bob_scope, monkeypatch):
    from memories.toolkit import enrichment
    from memories.toolkit.services import toolkit_candidates_enrich

    ltm = _ltm_candidate(alice)
    run(alice, "update_memory", memory_id=ltm["id"], metadata={f"k{n}": "v" for n in range(20 - len(ltm["metadata"]))})

    def broken(text):
        raise RuntimeError("model down")

    monkeypatch.setattr(enrichment, "enrich_text", broken)
    toolkit_candidates_enrich(memory_ids=[ltm["id"]])
    exported = _export(alice_scope)
    record = next(r for r in _records(exported) if r["id"] == ltm["id"])
    assert record["metadata"]["enrichment_attempts"] == 1 and len(record["metadata"]) == 22
    assert _import(bob_scope, exported).imported == 2


# --- A3: the enrichment's lease --------------------------------------------------------------------
def test_a3_an_export_taken_while_a_candidate_is_claimed_round_trips(alice, bob, alice_scope, bob_scope):
    from memories.toolkit.services import _candidate_claim, _candidate_enrich, toolkit_candidates_enrich

    ltm = _ltm_candidate(alice)
    claimed = _candidate_claim(memory_ids=None, exclude_ids=[], call=internal_call())
    assert claimed is not None and claimed[1] is not None
    # The lease is the engine's: not the memory's metadata, so not shown, counted or exported.
    assert "enrichment_claim" not in next(m for m in _all(alice) if m["id"] == ltm["id"])["metadata"]
    exported = _export(alice_scope)
    assert all("enrichment_claim" not in r["metadata"] for r in _records(exported))
    assert _import(bob_scope, exported).imported == 2
    # Bob's copy is no pending candidate (an import makes none): the heuristics enriched it.
    copy = next(m for m in _all(bob) if m["metadata"].get("tier") == "ltm")
    assert copy["metadata"]["enrichment_status"] == "completed"
    assert copy["metadata"]["enriched_by"] == "heuristic"
    assert toolkit_candidates_enrich(memory_ids=[copy["id"]]) == 0
    # Alice's claimed candidate is still held by its lease, and its holder still applies.
    assert toolkit_candidates_enrich(memory_ids=[ltm["id"]]) == 0
    item, claim = claimed
    assert _candidate_enrich(item, claim=claim, call=internal_call())
    assert next(m for m in _all(alice) if m["id"] == ltm["id"])["metadata"]["enrichment_status"] == "completed"


def test_a3_an_older_export_holding_a_lease_in_metadata_imports(alice, bob, alice_scope, bob_scope):
    ltm = _ltm_candidate(alice)
    records = _records(_export(alice_scope))
    for record in records:
        if record["id"] == ltm["id"]:
            record["metadata"]["enrichment_claim"] = {"until": "2999-01-01T00:00:00.000000+00:00", "token": "ab" * 16}
    assert _import(bob_scope, _file(records)).imported == 2
    assert all("enrichment_claim" not in m["metadata"] for m in _all(bob))


def test_a3_a_client_cannot_set_the_lease_key(alice):
    with pytest.raises(ServiceError) as refused:
        run(alice, "remember", memory="A fact.", metadata={"enrichment_claim": "x"})
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT and "reserved" in refused.value.message


# --- A4: history ----------------------------------------------------------------------------------
def test_a4_a_memory_changed_more_often_than_the_import_takes_round_trips(alice_scope, bob, bob_scope, monkeypatch):
    from memories import portability, services

    # The cap at 5 instead of 1000: the same code path, six updates instead of a thousand.
    monkeypatch.setattr(portability, "HISTORY_MAX_VERSIONS", 5)
    monkeypatch.setattr(services, "HISTORY_MAX_VERSIONS", 5)
    made = memory_remember(alice_scope, memory="counter 0", call=internal_call())
    for n in range(1, 7):
        memory_update(alice_scope, memory_id=made.id, memory=f"counter {n}", call=internal_call())
    exported = _export(alice_scope)
    (record,) = _records(exported)
    assert len(record["history"]) == 5 and record["history_omitted"] == 2  # 7 versions: ADD + 6 UPDATE
    assert [v["new_memory"] for v in record["history"]] == [f"counter {n}" for n in range(2, 7)]
    assert _import(bob_scope, exported).imported == 1
    (copy,) = _all(bob)
    from memories.selectors import memory_versions

    assert [v["new_memory"] for v in memory_versions(bob_scope, memory_id=copy["id"])] == [
        f"counter {n}" for n in range(2, 7)
    ]
    markdown = memory_export(alice_scope, file_format="markdown", call=internal_call()).content
    assert "5 newest of 7 versions" in markdown


def test_a4_records_under_the_cap_say_nothing_of_omitted_versions(alice_scope):
    made = memory_remember(alice_scope, memory="counter 0", call=internal_call())
    memory_update(alice_scope, memory_id=made.id, memory="counter 1", call=internal_call())
    (record,) = _records(_export(alice_scope))
    assert len(record["history"]) == 2 and "history_omitted" not in record


# --- A5: ingest ----------------------------------------------------------------------------------
def test_a5_ingest_drops_and_counts_facts_longer_than_a_memory_may_be(alice_scope, bob, bob_scope, llm):
    from memories.services import memory_ingest

    llm.queue_facts("User notes: " + "word " * 1700, "User likes green tea")
    added = memory_ingest(alice_scope, messages=[{"role": "user", "content": "Remember my notes."}],
                          call=internal_call())  # fmt: skip
    assert [a["memory"] for a in added] == ["User likes green tea"]
    row = AuditEvent.objects.get(operation=Operation.INGEST, outcome="ok")
    assert row.detail["too_long"] == 1 and row.memory_ids == [added[0]["id"]]
    exported = _export(alice_scope)
    assert [r["text"] for r in _records(exported)] == ["User likes green tea"]
    assert _import(bob_scope, exported).imported == 1


# --- export size vs. the import's limits ----------------------------------------------------------
def test_an_export_larger_than_one_import_takes_is_refused_with_the_way_in(alice_scope, bob_scope, settings):
    for n in range(3):
        memory_remember(alice_scope, memory=f"Fact number {n}.", call=internal_call())
    exported = _export(alice_scope)
    settings.IMPORT_MAX_MEMORIES = 2
    with pytest.raises(ServiceError) as refused:
        _import(bob_scope, exported)
    assert refused.value.code == ErrorCode.PAYLOAD_TOO_LARGE
    assert "manage.py import_memories" in refused.value.message
    settings.IMPORT_MAX_MEMORIES = 3
    assert _import(bob_scope, exported).imported == 3


# --- A9: issuing a key is audited -----------------------------------------------------------------
def test_a9_issuing_a_delegated_key_writes_an_audit_row_without_the_secret(alice, bob):
    call = CallContext(channel=Channel.INTERNAL, actor_username="ops", actor_auth="operator")
    api_key, plain = api_key_issue(
        user=bob, name="support bot", role=Role.PLATFORM, permissions=frozenset({"read"}), call=call
    )
    row = AuditEvent.objects.get(operation=Operation.API_KEY_ISSUE)
    assert row.request_id == call.request_id and row.actor_username == "ops"
    assert (row.subject_user_id, row.outcome) == (bob.pk, "ok")
    assert row.detail == {
        "key_id": api_key.key_id,
        "name": "support bot",
        "role": "platform",
        "permissions": ["read"],
        "expires_at": None,
    }
    secret = plain.rsplit("_", 1)[1]
    stored = json.dumps([row.detail, row.before, row.after, row.actor_username, row.user_agent])
    assert secret not in stored and plain not in stored


def test_a9_the_audit_row_commits_with_the_key_or_not_at_all(alice, monkeypatch):
    from memories import services

    def failing(*args, **kwargs):
        raise RuntimeError("audit store down")

    monkeypatch.setattr(services, "audit_record", failing)
    with pytest.raises(RuntimeError):
        api_key_issue(user=alice, name="laptop")
    from memories.models import ApiKey

    assert not ApiKey.objects.filter(user=alice).exists()


def test_a9_a_key_issued_without_a_call_is_recorded_as_internal(alice):
    api_key, _ = api_key_issue(user=alice, name="web")
    row = AuditEvent.objects.get(operation=Operation.API_KEY_ISSUE)
    assert (row.channel, row.subject_user_id, row.actor_user_id) == ("internal", alice.pk, alice.pk)
    assert row.detail["key_id"] == api_key.key_id and row.detail["role"] == "user"
