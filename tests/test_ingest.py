"""ingest runs mem0's real extraction pipeline against local fakes of the LLM APIs."""

import pytest

from memories import engine
from memories.services import memory_ingest, memory_list
from tests.conftest import internal_call
from tests.fakes import FakeGemini, FakeOpenAI

TURN = [
    {"role": "user", "content": "I just adopted a Welsh Corgi named Otis. He loves fetch."},
    {"role": "assistant", "content": "Congratulations! How old is he?"},
    {"role": "user", "content": "He's 8 weeks."},
]


@pytest.fixture
def rebuilt_engine():
    """The engine reads its LLM config when built: rebuild it around each test."""
    engine.engine_close()
    yield
    engine.engine_close()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors", "rebuilt_engine")
def test_ingest_with_an_openai_compatible_llm(settings, alice_scope):
    fake = FakeOpenAI().start()
    try:
        settings.LLM_BASE_URL = f"{fake.url}/v1"
        settings.LLM_MODEL = "local-model"
        settings.LLM_API_KEY = "fake-key"
        fake.queue_facts("User adopted Otis, a Welsh Corgi, 8 weeks old", "Otis enjoys playing fetch")

        added = memory_ingest(alice_scope, messages=TURN, metadata={"session_id": "abc123"}, call=internal_call())

        assert sorted(a["memory"] for a in added) == [
            "Otis enjoys playing fetch",
            "User adopted Otis, a Welsh Corgi, 8 weeks old",
        ]
        assert {a["event"] for a in added} == {"ADD"}
        request = fake.requests[0]
        assert request["json"]["model"] == "local-model"
        assert request["headers"]["authorization"] == "Bearer fake-key"
        assert "Welsh Corgi named Otis" in fake.prompts()[0]
        stored = memory_list(alice_scope, call=internal_call()).memories
        assert {m.memory for m in stored} == {a["memory"] for a in added}
        assert all(m.source == "ingest" and m.metadata == {"session_id": "abc123"} for m in stored)
    finally:
        fake.stop()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors", "rebuilt_engine")
def test_ingest_with_gemini(settings, monkeypatch, alice_scope):
    fake = FakeGemini().start()
    try:
        monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", fake.url)
        settings.GOOGLE_API_KEY = "fake-gemini-key"
        fake.queue_facts("User's dog Otis is a Welsh Corgi")

        added = memory_ingest(alice_scope, messages=TURN, call=internal_call())

        assert [a["memory"] for a in added] == ["User's dog Otis is a Welsh Corgi"]
        request = fake.requests[0]
        assert f"/models/{settings.GEMINI_LLM_MODEL}:generateContent" in request["path"]
        assert request["headers"].get("x-goog-api-key") == "fake-gemini-key"
        assert "Welsh Corgi named Otis" in fake.prompts()[0]
    finally:
        fake.stop()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors", "rebuilt_engine")
def test_ingest_without_llm(settings, alice_scope):
    from core.errors import ServiceError

    settings.LLM_BASE_URL = None
    settings.GOOGLE_API_KEY = None
    with pytest.raises(ServiceError) as excinfo:
        memory_ingest(alice_scope, messages=TURN, call=internal_call())
    assert excinfo.value.code == "llm_unavailable"
    assert memory_list(alice_scope, call=internal_call()).memories == []


@pytest.mark.slow
def test_ingest_over_mcp_and_clear_all_forgets_everything(mcp_as, alice_key, fake_llm):
    mcp = mcp_as(alice_key)
    mcp.ok("remember", {"memory": "My passport number is X1234567"})
    fake_llm.queue_facts("User is moving to Berlin next month")
    asked = len(fake_llm.requests)
    added = mcp.ok("ingest", {"messages": [{"role": "user", "content": "I'm moving to Berlin next month!"}]})
    assert [a["memory"] for a in added["results"]] == ["User is moving to Berlin next month"]
    first_prompt = fake_llm.prompts()[asked]
    assert "X1234567" in first_prompt  # existing memories reach the extraction prompt

    assert mcp.error("clear_all_memory", {})["code"] == "confirmation_required"
    assert mcp.ok("clear_all_memory", {"confirm": True}) == {"deleted": 2}
    for _ in range(4):
        assert mcp.ok("clear_all_memory", {"confirm": True}) == {"deleted": 0}
    limited = mcp.error("clear_all_memory", {"confirm": True})
    assert limited["code"] == "rate_limited" and 0 < limited["retry_after_s"] <= 3600
    assert mcp.ok("list_memory", {})["memories"] == []

    asked = len(fake_llm.requests)
    mcp.ok("ingest", {"messages": [{"role": "user", "content": "Anything new with me?"}]})
    later_prompt = fake_llm.prompts()[asked]
    assert "Anything new with me?" in later_prompt
    for cleared in ("X1234567", "Berlin", "passport"):
        assert cleared not in later_prompt
