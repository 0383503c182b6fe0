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


@pytest.mark.slow
def test_reembed_process_killed_and_resumed_while_a_server_answers_searches(alice, alice_key, fake_gemini):
    """Real processes: a live server answers searches the whole time (old vectors, then
    the new embedder's once it notices the switch, with no restart); `manage.py reembed`
    is SIGKILLed midway and a second run finishes the job."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time
    import urllib.request

    from core.scope import MemoryScope
    from tests.conftest import ROOT, free_port, service_env, wait_for

    scope = MemoryScope.for_user(alice)
    for topic in TOPICS:
        memory_remember(scope, memory=f"Alice's hobby is {topic}", call=internal_call())
    env = service_env(
        GOOGLE_API_KEY="fake-gemini-key",
        GOOGLE_GEMINI_BASE_URL=fake_gemini.url,
        RATE_LIMIT_SEARCH_MEMORY="100000/minute",
    )
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "memsite.asgi:application", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    answers: list[tuple[int, str]] = []
    stop = threading.Event()

    def search() -> tuple[int, str]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/memories/search",
            data=json.dumps({"query": "hobby beekeeping", "top_k": 1}).encode(),
            headers={"Authorization": f"Bearer {alice_key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - loopback
                return response.status, json.loads(response.read())["results"][0]["memory"]
        except urllib.error.HTTPError as exc:
            return exc.code, ""

    def keep_searching() -> None:
        while not stop.is_set():
            answers.append(search())
            time.sleep(0.05)

    try:

        def up() -> bool:
            try:
                return search()[0] == 200
            except OSError:
                return False

        wait_for(up, timeout=90, what="live server")
        searcher = threading.Thread(target=keep_searching, daemon=True)
        searcher.start()
        fake_gemini.embed_delay = 0.3
        command = [sys.executable, "manage.py", "reembed", "--to", "gemini", "--dims", str(NEW_DIMS), "--batch", "2"]
        first = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for line in first.stderr:
            if "->" in line and int(line.split(": ")[-1].split("/")[0]) >= 6:
                break
        os.killpg(first.pid, signal.SIGKILL)  # killed midway
        first.wait(30)
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM memories WHERE vector_next IS NOT NULL")
            done = cursor.fetchone()[0]
        assert 6 <= done < len(TOPICS) and _table_dims() == 384

        second = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stderr
        assert second.stdout.strip() == f"embedder gemini:{NEW_DIMS}"
        assert _table_dims() == NEW_DIMS
        switched_at = len(answers)
        wait_for(lambda: len(answers) > switched_at + 20, timeout=60, what="searches after the switch")
    finally:
        stop.set()
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    assert len(answers) > 40
    assert all(answer == (200, "Alice's hobby is beekeeping") for answer in answers), sorted(set(answers))
    # ...and the server embedded its queries with the new embedder after the switch, unrestarted.
    queries = [r for r in fake_gemini.requests if "hobby beekeeping" in json.dumps(r["json"])]
    assert queries
