"""Online re-embedding (issue 17, acceptance 4): from the local MiniLM embedder to a fake
Gemini embedder on loopback with other dimensions. Search answers throughout (on the old
vectors until the switch, on the new ones after); the run dies midway (the embedder goes
down), is resumed, and re-embeds only what was left; edits made during the run are
re-embedded; /healthz reports progress."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from core.errors import ServiceError
from memories.reembed import embedder_reembed, embedder_target
from memories.services import memory_remember, memory_search, memory_update
from tests.conftest import internal_call
from tests.fakes import FakeGemini

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

NEW_DIMS = 64
TOPICS = [
    "sailing", "violin", "cheese", "volcanoes", "chess", "tulips", "marathons", "origami", "jazz", "pottery",
    "astronomy", "falconry", "sushi", "fencing", "beekeeping", "calligraphy", "surfing", "knitting",
]  # fmt: skip


def _table_dims() -> int:
    from memories.engine.vector_schema import vector_table_dims

    with connection.cursor() as cursor:
        return vector_table_dims(cursor, "memories")


@pytest.fixture
def fake_gemini(settings, monkeypatch):
    fake = FakeGemini().start()
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", fake.url)
    settings.GOOGLE_API_KEY = "fake-gemini-key"
    yield fake
    fake.stop()
    # Put the table back as every other test expects it (384-d, no shadow column).
    from memories.engine import engine_reembed_abort
    from memories.engine.embedders import embedder_spec_refresh
    from memories.models import EmbedderState

    engine_reembed_abort()
    with connection.cursor() as cursor:
        for table in ("memories", "memories_entities"):
            cursor.execute(f'DELETE FROM "{table}"')  # noqa: S608 - our own table names
            cursor.execute(f'ALTER TABLE "{table}" ALTER COLUMN vector TYPE vector(384)')
    EmbedderState.objects.all().delete()
    embedder_spec_refresh()


def _embedded_texts(fake: FakeGemini) -> int:
    return sum(len(r["json"].get("requests", [])) for r in fake.requests if ":batchEmbedContents" in r["path"])


def _top(scope, query: str) -> str:
    return memory_search(scope, query=query, top_k=1, call=internal_call())[0].memory


def test_reembed_online_killed_and_resumed(alice_scope, fake_gemini, client):
    ids = {}
    for topic in TOPICS:
        ids[topic] = memory_remember(alice_scope, memory=f"Alice's hobby is {topic}", call=internal_call()).id
    target = embedder_target(name="gemini", dims=NEW_DIMS)
    seen = []

    def during(progress):
        seen.append(progress)
        # Search answers during the fill, from the old (local) vectors.
        assert _top(alice_scope, "which hobby involves bees and honey") == "Alice's hobby is beekeeping"
        if len(seen) == 2:
            fake_gemini.embed_failures = 10_000  # the embedder goes down: the run dies here
            memory_update(
                alice_scope, memory_id=ids["jazz"], memory="Alice's hobby is jazz piano", call=internal_call()
            )
            memory_remember(alice_scope, memory="Alice's hobby is kayaking", call=internal_call())

    with pytest.raises(Exception):  # noqa: B017, PT011 - the engine error of the dead embedder
        embedder_reembed(target=target, batch=4, progress=during)
    health = client.get("/healthz").json()
    assert health["embedder"] == "local:384"
    assert health["reembed"]["target"] == f"gemini:{NEW_DIMS}"
    done_before = health["reembed"]["done"]
    assert 0 < done_before < health["reembed"]["total"] == len(TOPICS) + 1
    assert _table_dims() == 384
    assert _top(alice_scope, "paddling a kayak on the river") == "Alice's hobby is kayaking"

    # Resumed: only what was left is embedded (edited and new rows included), then the switch.
    fake_gemini.embed_failures = 0
    sent_before = _embedded_texts(fake_gemini)
    call_command("reembed", "--to", "gemini", "--dims", str(NEW_DIMS), "--batch", "4")
    resumed = _embedded_texts(fake_gemini) - sent_before
    assert resumed < len(TOPICS) + 1  # not started over
    assert _table_dims() == NEW_DIMS
    health = client.get("/healthz").json()
    assert health["embedder"] == f"gemini:{NEW_DIMS}" and "reembed" not in health and health["status"] == "ok"

    # After the switch, search and writes use the new embedder's vectors.
    assert _top(alice_scope, "hobby jazz piano") == "Alice's hobby is jazz piano"
    assert _top(alice_scope, "hobby kayaking") == "Alice's hobby is kayaking"
    memory_remember(alice_scope, memory="Alice's hobby is climbing", call=internal_call())
    assert _top(alice_scope, "hobby climbing") == "Alice's hobby is climbing"
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM memories WHERE vector_dims(vector) <> %s", [NEW_DIMS])
        assert cursor.fetchone()[0] == 0
    # Running it again is a no-op.
    sent = _embedded_texts(fake_gemini)
    call_command("reembed", "--to", "gemini", "--dims", str(NEW_DIMS))
    assert _embedded_texts(fake_gemini) == sent


def test_reembed_refuses_bad_targets(settings, fake_gemini):
    with pytest.raises(ServiceError):
        embedder_target(name="local", dims=100)
    with pytest.raises(ServiceError):
        embedder_target(name="gemini", dims=0)
    settings.GOOGLE_API_KEY = None
    with pytest.raises(CommandError, match="GOOGLE_API_KEY"):
        call_command("reembed", "--to", "gemini")
    with pytest.raises(CommandError, match="--to"):
        call_command("reembed")
