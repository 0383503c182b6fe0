"""What a web process does once, before it takes requests.

1. Load the memory engine (mem0, the vector store's pool, the local embedder's model), so
   that the first call does not pay 1-2 s for it.
2. Move every object then alive into the garbage collector's permanent generation
   (`gc.freeze`). A warm web process holds about 340,000 objects the collector tracks
   (Django, DRF, mem0, pydantic models, the MCP SDK); a full collection walks all of them
   and took 160-230 ms on the bench machine, with the GIL held, so every request of the
   process stalled for that long, about once every 1,400 calls under load
   (docs/benchmarks.md). Frozen, they are never walked again; what requests allocate is
   collected as before. The price: a frozen object that later becomes cyclic garbage is
   never freed, which is why this runs once, after start-up, and not per request.

Best effort: a database that is not up yet only means the first call loads the engine.
"""

from __future__ import annotations

import gc
import logging
import os
import time

from django.db import connections

from memories.engine import engine_warm_up

logger = logging.getLogger(__name__)

_started_in_pid: int | None = None


def web_process_start() -> None:
    """Warm the engine and freeze the start-up heap, once per process (run off the event
    loop: it embeds and touches the database)."""
    global _started_in_pid
    if _started_in_pid == os.getpid():
        return
    _started_in_pid = os.getpid()
    started = time.perf_counter()
    try:
        engine_warm_up()
    except Exception as exc:  # noqa: BLE001 - best effort; the first call retries and reports
        logger.warning("engine warm-up failed (%s); the first call will load the engine", type(exc).__name__)
    finally:
        connections.close_all()  # this thread's connections; requests use their own
    gc.collect()
    gc.freeze()
    logger.info(
        "web process ready: engine warm, %d objects frozen in %.0f ms",
        gc.get_freeze_count(),
        (time.perf_counter() - started) * 1000,
    )
