"""A web process loads its engine and freezes its start-up heap before it takes requests
(memsite/process_start.py), and starts all the same when the warm-up cannot run."""

import asyncio
import gc
import logging

import pytest

from memories.engine import engine_close, mem0_adapter
from memories.engine.embedders import embedder_spec_refresh
from memsite import process_start
from memsite.asgi import build_application  # sets up Django's logging now, not under caplog


async def _start_and_stop(application) -> list[str]:
    inbox, outbox = asyncio.Queue(), asyncio.Queue()
    task = asyncio.create_task(application({"type": "lifespan"}, inbox.get, outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    started = (await outbox.get())["type"]
    await inbox.put({"type": "lifespan.shutdown"})
    stopped = (await outbox.get())["type"]
    await task
    return [started, stopped]


@pytest.fixture
def new_process(monkeypatch):
    """This process as a fresh web process would be: engine not built, nothing frozen."""
    monkeypatch.setattr(process_start, "_started_in_pid", None)
    engine_close()
    embedder_spec_refresh()  # the active embedder is read from the database again
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the test session collects as before


@pytest.mark.django_db(transaction=True)
def test_start_up_builds_the_engine_and_freezes_the_heap(new_process, caplog):
    assert mem0_adapter._state["memory"] is None
    caplog.set_level(logging.INFO)
    assert asyncio.run(_start_and_stop(build_application())) == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
    ]
    assert mem0_adapter._state["memory"] is not None  # the first call will not build it
    assert gc.get_freeze_count() > 10_000  # Django, mem0, the SDK: never walked again
    assert "web process ready: engine warm" in caplog.text

    process_start.web_process_start()  # a second app in the same process: nothing again
    assert caplog.text.count("web process ready") == 1


def test_start_up_completes_when_the_warm_up_cannot_reach_the_database(new_process, caplog):
    """No database access here (pytest-django blocks it, as a database still starting
    would refuse it): the process starts, says why in one line, names no content."""
    caplog.set_level(logging.INFO)
    assert asyncio.run(_start_and_stop(build_application()))[0] == "lifespan.startup.complete"
    assert "engine warm-up failed (RuntimeError); the first call will load the engine" in caplog.text
    assert gc.get_freeze_count() > 0
