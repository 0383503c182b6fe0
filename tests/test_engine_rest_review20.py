"""Review 20 of the engine and seed 001: the model's answer in mem0's ingest is cleaned of
what Postgres cannot store (and mem0's messages, which quote memory content, are withheld
from the logs); a query-string scope claim with a NUL is a coded 400; metadata's byte
limit counts UTF-8 bytes; seed 001 names `limit` in its errors; a write racing
`manage.py reembed`'s switch stores the new embedder's vector."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid

import pytest
from django.db import connection

from audit.models import AuditEvent
from core.choices import Role
from core.errors import ServiceError
from core.scope import CallContext
from memories import schemas
from memories import services as memory_services
from memories.auth import Principal
from memories.engine import embedders, engine_embed_text
from memories.engine.mem0_adapter import llm_answer_storable
from memories.operations import operation_execute
from memories.reembed import embedder_reembed, embedder_target
from memories.services import api_key_issue, memory_ingest, memory_list, memory_remember, memory_update
from memories.tenancy import tenant_user_create
from tests import test_rest_review18
from tests.conftest import InThread, held_after, internal_call

TURN = [
    {"role": "user", "content": "I like tea and coffee."},
    {"role": "assistant", "content": "Noted."},
]


def _stored(scope) -> list[str]:
    return sorted(m.memory for m in memory_list(scope, call=internal_call()).memories)


# --- 1. mem0 ingest: the model's answer ----------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ('{"memory": [{"text": "Likes tea\\u0000 a lot"}]}', {"memory": [{"text": "Likes tea a lot"}]}),
        ('{"memory": [{"text": "Likes tea\x00"}]}', {"memory": [{"text": "Likes tea"}]}),
        ('{"memory": [{"text": "tea \\ud800"}]}', {"memory": [{"text": "tea \ufffd"}]}),
        ('```json\n{"memory": [{"text": "a\\u0000b"}]}\n```', {"memory": [{"text": "ab"}]}),
    ],
    ids=["escaped-nul", "raw-nul", "lone-surrogate", "code-fence"],
)
def test_the_llm_answer_loses_what_postgres_cannot_store(answer, expected):
    assert json.loads(llm_answer_storable(answer)) == expected


def test_a_clean_llm_answer_is_left_as_it_came():
    answer = '{"memory": [{"text": "Likes \\ud83d\\ude00 and caf\\u00e9"}]}'  # a surrogate pair is fine
    assert llm_answer_storable(answer) == answer
    assert llm_answer_storable("not json at all") == "not json at all"
    assert llm_answer_storable({"tool_calls": []}) == {"tool_calls": []}


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors")
def test_an_answer_whose_only_fact_has_a_nul_is_stored_cleaned_and_not_logged(llm, alice_scope, caplog):
    llm.queue_facts("My PIN hint is tea\x00time")
    added = memory_ingest(alice_scope, messages=TURN, call=internal_call())
    assert [a["memory"] for a in added] == ["My PIN hint is teatime"]
    assert _stored(alice_scope) == ["My PIN hint is teatime"]
    assert not [r for r in caplog.records if "PIN hint" in r.getMessage()]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors")
def test_a_nul_fact_beside_a_storable_one_is_not_dropped(llm, alice_scope):
    """The usual case: the user has memories (mem0 looks for related ones per fact)."""
    llm.queue_facts("Likes coffee")
    memory_ingest(alice_scope, messages=TURN, call=internal_call())
    llm.queue_facts("Likes tea\x00 a lot", "Plays the cello")
    memory_ingest(alice_scope, messages=TURN, call=internal_call())
    assert _stored(alice_scope) == ["Likes coffee", "Likes tea a lot", "Plays the cello"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors")
def test_a_lone_surrogate_fact_is_stored_with_a_replacement_character(llm, alice_scope):
    llm.queue_answer({"memory": [{"text": "Likes tea \ud800"}, {"text": "Likes coffee"}]})
    memory_ingest(alice_scope, messages=TURN, call=internal_call())
    assert _stored(alice_scope) == ["Likes coffee", "Likes tea \ufffd"]


@pytest.mark.parametrize("name", ["mem0.memory.main", "mem0.memory.utils", "mem0.vector_stores.pgvector"])
def test_mem0_messages_are_withheld_from_the_logs(caplog, name):
    """mem0 formats its messages with f-strings that quote facts and the database's error
    (whose CONTEXT line quotes the fact again): only where it happened is logged."""
    logging.getLogger(name).error('Failed to insert memory 1: ... "data": "My PIN hint is tea"')
    logging.getLogger(name).warning("Skipping invalid message format: {'content': 'My PIN hint'}")
    messages = [r.getMessage() for r in caplog.records if r.name == name]
    assert len(messages) == 2
    assert all("PIN" not in m and "message withheld" in m for m in messages), messages


# --- 2. seed 001: a query-string scope claim with a NUL ------------------------------------


# The same delegating keys and tenant fixture as review 18's REST tests.
acme = test_rest_review18.acme
_key = test_rest_review18._key


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors")
@pytest.mark.parametrize(
    "claim",
    [{"user_id": "ann\x00"}, {"tenant_id": "acme", "user_id": "\x00"}, {"tenant_id": "ac\x01me"}],
    ids=["user-nul", "tenant-and-user-nul", "tenant-control"],
)
def test_a_list_claiming_an_unstorable_user_id_is_a_coded_400(acme, api_client, claim):
    tenant_user_create(tenant=acme, username="ann")
    bot = tenant_user_create(tenant=acme, username="acme-bot")
    client = api_client(_key(bot, "read", role=Role.TENANT_ADMIN))
    client.raise_request_exception = False
    before = AuditEvent.objects.count()
    response = client.get("/v1/memory", claim)
    assert response.status_code == 400, response.content[:300]
    assert response.json()["error"]["code"] == "invalid_argument"
    assert "contains" in response.json()["error"]["message"]
    assert AuditEvent.objects.count() == before + 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors")
@pytest.mark.parametrize("method", ["delete", "forget"])
def test_a_delete_claiming_a_nul_user_id_is_a_coded_400(acme, api_client, method):
    tenant_user_create(tenant=acme, username="ann")
    bot = tenant_user_create(tenant=acme, username="acme-bot")
    client = api_client(_key(bot, "read", "write", "delete", role=Role.TENANT_ADMIN))
    client.raise_request_exception = False
    if method == "delete":
        response = client.delete(f"/v1/memory/{uuid.uuid4()}?user_id=%00")
    else:
        response = client.post(f"/v1/memory/{uuid.uuid4()}/forget?tenant_id=acme&user_id=ann%00")
    assert response.status_code == 400, response.content[:300]
    error = response.json()["error"]
    assert (error["code"], error["message"]) == ("invalid_argument", "user_id: contains a NUL character")


# --- 3. metadata's byte limit counts UTF-8 bytes -------------------------------------------


def _remember(user, **arguments):
    principal = Principal(user=user, method="api_key")
    try:
        return ("ok", operation_execute(principal, "remember", arguments, call=CallContext(channel="mcp")))
    except ServiceError as exc:
        return (exc.code.value, exc.message)


@pytest.mark.django_db
@pytest.mark.usefixtures("clean_vectors")
@pytest.mark.parametrize("char", ["\U0001f600", "\u00e9", "\u4e2d"], ids=["emoji", "latin", "cjk"])
def test_one_metadata_value_within_the_published_limits_is_stored(alice, char):
    """maxLength 1000 for a value, "at most 8192 bytes as JSON": one 1000-character value
    is 1002-4012 bytes of UTF-8 JSON (12012 ASCII-escaped, for the emoji)."""
    metadata = {"note": char * schemas.METADATA_VALUE_MAX_CHARS}
    assert schemas.metadata_json_bytes(metadata) <= schemas.METADATA_MAX_BYTES
    result = _remember(alice, memory=f"fact {char}", metadata=metadata)
    assert result[0] == "ok", result


@pytest.mark.django_db
def test_metadata_past_the_limit_in_utf8_bytes_is_still_refused(alice):
    metadata = {f"k{n}": "\U0001f600" * 900 for n in range(3)}  # 3 x 3600+ bytes
    assert schemas.metadata_json_bytes(metadata) > schemas.METADATA_MAX_BYTES
    result = _remember(alice, memory="too much", metadata=metadata)
    assert result == ("payload_too_large", f"metadata: metadata exceeds {schemas.METADATA_MAX_BYTES} bytes")


@pytest.mark.django_db
@pytest.mark.usefixtures("clean_vectors")
@pytest.mark.parametrize(
    "arguments",
    [
        {"importance": True},
        {"importance": 1e308},
        {"metadata": {"n": 10**99}},
        {"importance": -0.0},
        {"ttl_days": True},
        {"ttl_days": 1.0},
    ],
    ids=["importance-bool", "importance-huge", "meta-huge-int", "importance-negzero", "ttl-bool", "ttl-float"],
)
def test_numbers_at_the_edges_are_stored_or_refused_with_a_code(alice, arguments):
    assert _remember(alice, memory="number edge", **arguments)[0] in ("ok", "invalid_argument", "payload_too_large")


# --- 4. seed 001 names `limit` -------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors")
def test_seed001_limit_errors_name_limit(alice, api_client):
    client = api_client(api_key_issue(user=alice, name="k")[1])
    answers = [
        client.post("/v1/memory/search", {"query": "x", "limit": 0}, format="json"),
        client.post("/v1/memory/search", {"query": "x", "limit": None}, format="json"),
        client.post("/v1/memory/search", {"query": "x", "limit": True}, format="json"),
        client.post("/v1/memory/search", {"query": "x", "limit": schemas.TOP_K_MAX + 1}, format="json"),
        client.get("/v1/memory", {"limit": "500"}),
        client.get("/v1/memory", {"limit": "ten"}),
    ]
    for answer in answers:
        assert answer.status_code == 400, answer.content[:300]
        error = answer.json()["error"]
        assert error["code"] == "invalid_argument"
        assert error["message"].startswith("limit:"), error
        assert "top_k" not in error["message"] and "page_size" not in error["message"]
    assert client.post("/v1/memory/search", {"query": "x", "limit": 3}, format="json").status_code == 200
    assert client.get("/v1/memory", {"limit": "2"}).status_code == 200


# --- 5. a write racing `manage.py reembed`'s switch ---------------------------------------


def _cos(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def _stored_vector(memory_id: str) -> list[float]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT vector::text FROM memories WHERE id = %s", [memory_id])
        return [float(x) for x in cursor.fetchone()[0].strip("[]").split(",")]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors")
@pytest.mark.parametrize("write", ["remember", "update"])
def test_a_write_racing_the_reembed_switch_stores_the_new_models_vector(alice_scope, fake_gemini, monkeypatch, write):
    """The write embeds with the old model (local:384), is held, the re-embedding runs to
    its switch (gemini:384, same dimensions), then the write commits: its row must hold
    the new model's vector, not the old one, which nothing would ever notice."""
    # The process keeps one embedder per spec; a Gemini one would call an earlier test's fake.
    monkeypatch.setitem(embedders._cache, "embedders", {})
    for topic in ("sailing", "violin", "cheese"):
        memory_remember(alice_scope, memory=f"Alice's hobby is {topic}", call=internal_call())
    target = memory_remember(alice_scope, memory="Alice's hobby is knitting", call=internal_call()).id
    text = "Alice's hobby is beekeeping"
    embedded, go = threading.Event(), threading.Event()
    captured = {}
    original = memory_services.engine_embed_text

    def held(value):
        result = original(value)
        if value == text:
            captured["old"] = result.vector
            embedded.set()
            assert go.wait(120)
        return result

    monkeypatch.setattr(memory_services, "engine_embed_text", held)
    if write == "remember":
        writing = InThread(lambda: memory_remember(alice_scope, memory=text, call=internal_call()).id)
    else:
        writing = InThread(lambda: memory_update(alice_scope, memory_id=target, memory=text, call=internal_call()).id)
    try:
        assert embedded.wait(60)
        progress = embedder_reembed(target=embedder_target(name="gemini", dims=384), batch=16)
        assert progress.active == "gemini:384"
    finally:
        go.set()
    stored = _stored_vector(writing.result())
    expected = engine_embed_text(text)
    assert expected.spec.label == "gemini:384"
    assert _cos(stored, captured["old"]) < 0.99
    assert _cos(stored, expected.vector) > 0.99, "the row holds the old embedder's vector"


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors")
def test_a_write_holding_its_row_when_the_switch_starts_is_waited_for(alice_scope, fake_gemini, monkeypatch):
    """The update has locked its row (inside its transaction) when the switch begins: the
    switch waits for it (no deadlock: the writer took the table's write lock first), then
    embeds the row the update left for it with the new model."""
    monkeypatch.setitem(embedders._cache, "embedders", {})
    target = memory_remember(alice_scope, memory="Alice's hobby is knitting", call=internal_call()).id
    text = "Alice's hobby is beekeeping"
    embedder_reembed(target=embedder_target(name="gemini", dims=384), batch=16, switch=False)
    locked, go = held_after(monkeypatch, memory_services, "engine_lock_owned")
    updating = InThread(lambda: memory_update(alice_scope, memory_id=target, memory=text, call=internal_call()).id)
    try:
        assert locked.wait(60)
        switching = InThread(lambda: embedder_reembed(target=embedder_target(name="gemini", dims=384), batch=16))
        time.sleep(2)  # past Postgres's deadlock_timeout (1 s): a lock cycle would be broken by now
        assert not switching.done()  # waiting for the update's transaction
    finally:
        go.set()
    assert updating.result() == target
    assert switching.result().active == "gemini:384"
    assert _cos(_stored_vector(target), engine_embed_text(text).vector) > 0.99
