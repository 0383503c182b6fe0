"""The memory engine: mem0 run in-process. Only this package imports mem0.

One `Memory` per process, built lazily on first use (so after any fork), with:
- vectors in Postgres/pgvector (table created by a Django migration, exact scan);
- our offline MiniLM embedder, or Gemini when EMBEDDER=gemini;
- mem0's history and raw-message store on Postgres (Django models), not SQLite;
- telemetry off and MEM0_DIR under the data dir, set before mem0 is imported.
Any failure inside mem0 or its vendors surfaces as `EngineError`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, cast

from django.conf import settings
from django.db import connections

from core.metrics import embedder_timed, engine_timed
from core.scope import MemoryScope
from memories.engine.payload import (
    KEY_ATTRS,
    KEY_REQUEST_ID,
    KEY_TRASH,
    EngineMemory,
    MemoryAttrs,
    engine_memory_from_item,
    engine_timestamp,
)
from memories.engine.vector_schema import vector_table_dims

logger = logging.getLogger(__name__)

UNCONFIGURED_LLM_KEY = "llm-not-configured"


class EngineError(RuntimeError):
    """mem0, its vector store, embedder or LLM failed. The message is safe to log."""


class LlmUnavailable(EngineError):
    """`ingest` needs an LLM and none is configured."""


_lock = threading.Lock()
_state: dict[str, Any] = {"pid": None, "memory": None}
# True while `engine_ingest` runs on this thread, for mem0's searches inside that call
# (`_ingest_hashes_hidden`).
_in_ingest: ContextVar[bool] = ContextVar("memsite_in_ingest", default=False)


def _prepare_environment() -> None:
    os.environ["MEM0_TELEMETRY"] = "False"
    settings.MEM0_DIR.mkdir(parents=True, exist_ok=True)
    os.environ["MEM0_DIR"] = str(settings.MEM0_DIR)


def llm_configured() -> bool:
    return bool(settings.GOOGLE_API_KEY or settings.LLM_BASE_URL)


def _llm_config() -> dict[str, Any]:
    if settings.GOOGLE_API_KEY:
        return {
            "provider": "gemini",
            "config": {
                "model": settings.GEMINI_LLM_MODEL,
                "api_key": settings.GOOGLE_API_KEY,
                "max_tokens": settings.LLM_MAX_TOKENS,
            },
        }
    if settings.LLM_BASE_URL:
        return {
            "provider": "openai",
            "config": {
                "model": settings.LLM_MODEL,
                "api_key": settings.LLM_API_KEY or "none",
                "openai_base_url": settings.LLM_BASE_URL,
                "max_tokens": settings.LLM_MAX_TOKENS,
            },
        }
    # mem0 wants an LLM even for infer=False; this one is never called (see ingest).
    return {"provider": "openai", "config": {"api_key": UNCONFIGURED_LLM_KEY}}


def _embedder_config() -> dict[str, Any]:
    if settings.EMBEDDER == "gemini":
        return {
            "provider": "gemini",
            "config": {
                "model": settings.GEMINI_EMBEDDING_MODEL,
                "api_key": settings.GOOGLE_API_KEY,
                "embedding_dims": settings.GEMINI_EMBEDDING_DIMS,
            },
        }
    # Replaced by MiniLMEmbedder right after construction; building an OpenAI client
    # makes no network call.
    return {"provider": "openai", "config": {"api_key": "local-embedder", "embedding_dims": 384}}


def database_conninfo(db: dict[str, Any]) -> str:
    """A libpq keyword string for the engine's own pool (mem0 talks psycopg directly)."""
    from psycopg.conninfo import make_conninfo

    parts = {
        "host": db.get("HOST"),
        "port": db.get("PORT"),
        "user": db.get("USER"),
        "password": db.get("PASSWORD"),
        "dbname": db.get("NAME"),
    }
    extra = {k: v for k, v in (db.get("OPTIONS") or {}).items() if k in ("sslmode", "sslrootcert")}
    return make_conninfo(**{k: str(v) for k, v in parts.items() if v}, **extra)


def _vector_pool() -> Any:
    """mem0's own psycopg pool, built by us so that it checks a connection on checkout: after
    Postgres restarts, a stale connection is replaced instead of failing the next call.
    mem0 closes it with the Memory (its __del__)."""
    from psycopg_pool import ConnectionPool

    pool = ConnectionPool(
        conninfo=database_conninfo(connections["default"].settings_dict),
        min_size=1,
        max_size=8,
        open=False,
        check=ConnectionPool.check_connection,
        timeout=settings.DATABASE_POOL_TIMEOUT_S,
        reconnect_timeout=settings.DATABASE_POOL_RECONNECT_TIMEOUT_S,
    )
    pool.open(wait=False)  # like mem0: do not block start-up on a database still coming up
    return pool


def _build_memory() -> Any:
    _prepare_environment()
    from mem0 import Memory
    from mem0.configs.base import MemoryConfig

    from memories.engine.history_store import PostgresHistoryStore

    config = MemoryConfig(
        vector_store={
            "provider": "pgvector",
            "config": {
                "connection_pool": _vector_pool(),
                "collection_name": settings.MEMORY_COLLECTION,
                "embedding_model_dims": settings.EMBEDDING_DIMS,
                "hnsw": settings.MEMORY_HNSW,
                "diskann": False,
            },
        },
        embedder=_embedder_config(),
        llm=_llm_config(),
        history_db_path=":memory:",
    )
    memory = Memory(config)
    _hide_dead_rows(memory.vector_store)
    _ingest_hashes_hidden(memory.vector_store)
    memory.db.close()
    memory.db = PostgresHistoryStore()
    if settings.EMBEDDER == "local":
        from memories.engine.embedder import MiniLMEmbedder

        memory.embedding_model = MiniLMEmbedder()
    else:
        memory.embedding_model.client = gemini_client_bounded(total_s=settings.EMBEDDER_TIMEOUT_S, retries=0)
    _embedder_instrument(memory.embedding_model)
    from memories.engine.embedders import ActiveEmbedder
    from memories.engine.writes import mem0_inserts_checked

    memory.embedding_model = ActiveEmbedder(memory.embedding_model)
    mem0_inserts_checked(memory.vector_store)
    if llm_configured():
        _llm_client_bounded(memory.llm)
    memory.llm.generate_response = _answers_storable(memory.llm.generate_response)
    return memory


# What Postgres can store neither as text nor as jsonb (`unsupported Unicode escape sequence`).
_UNSTORABLE = re.compile(r"[\x00\ud800-\udfff]")


def text_without_unstorable(text: str) -> str:
    """`text` with NUL dropped and each lone surrogate replaced by U+FFFD."""
    return _UNSTORABLE.sub(lambda match: "" if match.group() == "\x00" else "\ufffd", text)


def _json_without_unstorable(value: Any) -> Any:
    if isinstance(value, str):
        return text_without_unstorable(value)
    if isinstance(value, list):
        return [_json_without_unstorable(item) for item in value]
    if isinstance(value, dict):
        return {text_without_unstorable(str(k)): _json_without_unstorable(v) for k, v in value.items()}
    return value


def llm_answer_storable(answer: Any) -> Any:
    """The LLM's answer without what no memory can hold: NUL and lone surrogates, raw or
    as JSON escapes (mem0 decodes `\\u0000` into a fact). The answer is untrusted text; a
    fact mem0 cannot store fails the ingest, the same on every retry, and mem0 logs the
    database's error, which quotes the fact. Anything but text passes unchanged."""
    if not isinstance(answer, str):
        return answer
    from mem0.memory.utils import extract_json, remove_code_blocks

    text = text_without_unstorable(answer)
    body = remove_code_blocks(text)
    for candidate in (body, extract_json(body)):
        try:
            value = json.loads(candidate, strict=False)
        except (ValueError, RecursionError):
            continue
        cleaned = _json_without_unstorable(value)
        return text if cleaned == value else json.dumps(cleaned, ensure_ascii=False)
    return text


def _answers_storable(generate: Callable[..., Any]) -> Callable[..., Any]:
    def generate_storable(*args: Any, **kwargs: Any) -> Any:
        return llm_answer_storable(generate(*args, **kwargs))

    return generate_storable


# An answer is at most LLM_MAX_TOKENS tokens in a JSON envelope: a few hundred KB at worst.
# A body past this is not an answer, and reading it would hold the call and the memory.
_LLM_MAX_RESPONSE_BYTES = 4 * 1024 * 1024


def _llm_client_bounded(llm: Any) -> None:
    """Give mem0's LLM client a total deadline and few retries. mem0 builds it with the
    SDK defaults (OpenAI: 600 s per read, 2 retries; Gemini: no timeout), and a per-read
    timeout never ends a call whose server drips its answer a byte at a time."""
    from core.http_deadline import Httpx2DeadlineTransport

    if settings.GOOGLE_API_KEY:
        llm.client = gemini_client_bounded(total_s=settings.LLM_TIMEOUT_S, retries=settings.LLM_MAX_RETRIES)
        return
    import httpx2

    transport = Httpx2DeadlineTransport(total_s=settings.LLM_TIMEOUT_S, max_bytes=_LLM_MAX_RESPONSE_BYTES)

    llm.client = llm.client.with_options(
        http_client=httpx2.Client(transport=transport),
        timeout=settings.LLM_TIMEOUT_S,
        max_retries=settings.LLM_MAX_RETRIES,
    )


def gemini_client_bounded(*, total_s: float, retries: int) -> Any:
    """A Gemini client whose every request ends within `total_s` in all (and is tried
    1 + `retries` times): mem0 builds it with no timeout, for the LLM and the embedder."""
    from google import genai
    from google.genai import types

    from core.http_deadline import Httpx2DeadlineTransport

    transport = Httpx2DeadlineTransport(total_s=total_s, max_bytes=_LLM_MAX_RESPONSE_BYTES)
    return genai.Client(
        api_key=settings.GOOGLE_API_KEY,
        http_options=types.HttpOptions(
            timeout=int(total_s * 1000),
            client_args={"transport": transport},
            retry_options=types.HttpRetryOptions(attempts=1 + retries),
        ),
    )


def _live_payload(payload: Any) -> bool:
    if not isinstance(payload, dict) or KEY_TRASH in payload:
        return False
    attrs = payload.get(KEY_ATTRS)
    expires = attrs.get("expires_at") if isinstance(attrs, dict) else None
    return not (isinstance(expires, str) and expires <= engine_timestamp(datetime.now(UTC)))


def _hide_dead_rows(vector_store: Any) -> None:
    """mem0's own searches (the existing memories an `ingest` extraction sees and may
    update) must not see memories in the trash or expired ones, like ours."""
    for name in ("search", "keyword_search"):
        original = getattr(vector_store, name, None)
        if original is None:
            continue

        def live_only(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            results = _original(*args, **kwargs)
            return [r for r in results or [] if _live_payload(getattr(r, "payload", None))]

        setattr(vector_store, name, live_only)


def _ingest_hashes_hidden(vector_store: Any) -> None:
    """In an ingest, the existing memories mem0's add finds lose their `hash` (mem0's md5
    of the text) on the way to mem0. mem0 drops an extracted fact whose md5 one of them
    carries, silently, before our dedupe rule runs: a fact exactly equal to a memory the
    user has was answered with nothing ([] when every fact was one), where the rule
    (`services._ingest_complete`) answers NONE with the id of the memory that holds it, or
    keeps the fact as a narrowed store's own copy when that memory is outside the call's
    agent or session (our attrs, not mem0's filters). mem0 only ever saw the few memories
    its search found, so the rule decided the rest anyway. The LLM still sees their texts;
    mem0's own check of two equal facts in one call is kept (one memory, answered once)."""
    original = vector_store.search

    def hashes_hidden_in_ingest(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
        results = _original(*args, **kwargs)
        if not _in_ingest.get():
            return results
        return [
            r.model_copy(update={"payload": {k: v for k, v in r.payload.items() if k != "hash"}})
            if isinstance(r.payload, dict)
            else r
            for r in results or []
        ]

    vector_store.search = hashes_hidden_in_ingest


def _embedder_instrument(embedder: Any, *, name: str | None = None) -> None:
    """Time every embedding (memsite_embed_duration_seconds), whichever embedder it is,
    and keep recent single-text vectors (a repeat is not timed: nothing was embedded)."""
    from memories.engine.embedders import embed_cached

    name = name or settings.EMBEDDER
    timed = embedder_timed(embedder.embed, embedder=name, kind="one")
    embedder.embed = embed_cached(timed, size=settings.EMBEDDER_CACHE_SIZE, ttl_s=settings.EMBEDDER_CACHE_TTL_S)
    if hasattr(embedder, "embed_batch"):
        embedder.embed_batch = embedder_timed(embedder.embed_batch, embedder=name, kind="batch")


def get_memory() -> Any:
    """This process's mem0 `Memory`, built on first use (after fork)."""
    pid = os.getpid()
    if _state["pid"] == pid and _state["memory"] is not None:
        return _state["memory"]
    with _lock:
        if _state["pid"] != pid or _state["memory"] is None:
            try:
                _state["memory"] = _build_memory()
            except Exception as exc:
                raise EngineError(f"memory engine failed to start: {type(exc).__name__}") from exc
            _state["pid"] = pid
    return _state["memory"]


def engine_close() -> None:
    """Close this process's engine and its connection pool (e.g. before dropping a database)."""
    with _lock:
        memory = _state["memory"]
        _state.update(pid=None, memory=None)
    if memory is not None:
        memory.vector_store.connection_pool.close()


def _call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        with engine_timed(what):  # memsite_engine_duration_seconds{action=what}
            return fn(*args, **kwargs)
    except EngineError:
        raise
    except Exception as exc:
        # Vendor messages can echo request bodies or keys: log the type, not the text.
        logger.warning("engine %s failed: %s", what, type(exc).__name__)
        raise EngineError(f"memory engine {what} failed ({type(exc).__name__})") from exc


# --- operations -------------------------------------------------------------------
def _with_attrs(metadata: dict[str, Any] | None, attrs: MemoryAttrs | None) -> dict[str, Any]:
    return {**(metadata or {}), KEY_ATTRS: (attrs or MemoryAttrs()).as_payload()}


def engine_add_text(
    scope: MemoryScope, *, text: str, metadata: dict[str, Any] | None = None, attrs: MemoryAttrs | None = None
) -> str:
    """Store `text` verbatim (infer=False, no LLM). Returns the new memory id."""
    memory = get_memory()
    result = _call(
        "add",
        memory.add,
        [{"role": "user", "content": text}],
        user_id=scope.engine_user_id,
        metadata=_with_attrs(metadata, attrs),
        infer=False,
    )
    rows = result.get("results") or []
    if len(rows) != 1:
        raise EngineError(f"memory engine add stored {len(rows)} rows, expected 1")
    return str(rows[0]["id"])


def engine_ingest(
    scope: MemoryScope,
    *,
    messages: list[dict[str, str]],
    metadata: dict[str, Any] | None = None,
    attrs: MemoryAttrs | None = None,
    request_id: str | None = None,
) -> list[dict[str, Any]]:
    """mem0's full pipeline (infer=True): one LLM extraction call, dedup, store. mem0
    commits on its own; rows carry `request_id` so a crashed call's rows can be found."""
    if not llm_configured():
        raise LlmUnavailable("no LLM is configured for ingest")
    from memories.engine.embedders import added_specs_take

    memory = get_memory()
    added_specs_take()  # nothing noted by an earlier call on this thread that never inserted
    tagged = {**(metadata or {}), **({KEY_REQUEST_ID: request_id} if request_id else {})}
    token = _in_ingest.set(True)
    try:
        result = _call(
            "ingest",
            memory.add,
            messages,
            user_id=scope.engine_user_id,
            metadata=_with_attrs(tagged, attrs),
            infer=True,
        )
    finally:
        _in_ingest.reset(token)
    return list(result.get("results") or [])


def engine_embed_query(text: str) -> list[float]:
    """The query vector the engine would search with."""
    from memories.engine.embedders import embedder_active

    return cast(list[float], _call("embed", embedder_active().embed, text, "search"))


def engine_get(memory_id: str) -> EngineMemory | None:
    """Any user's memory by id; callers check ownership against their scope."""
    memory = get_memory()
    item = _call("get", memory.get, memory_id)
    return engine_memory_from_item(item) if item else None


def engine_update(
    memory_id: str, *, text: str | None, metadata: dict[str, Any] | None, attrs: MemoryAttrs | None = None
) -> None:
    """Change text (re-embedded), merge metadata, replace the fields (when given)."""
    memory = get_memory()
    changes = dict(metadata or {})
    if attrs is not None:
        changes[KEY_ATTRS] = attrs.as_payload()
    _call("update", memory.update, memory_id, text=text, metadata=changes or None)


def engine_delete(memory_id: str) -> None:
    memory = get_memory()
    _call("delete", memory.delete, memory_id)


def engine_purge_user(scope: MemoryScope) -> None:
    """Remove every memory of the user and mem0's raw messages for them."""
    memory = get_memory()
    _call("delete_all", memory.delete_all, user_id=scope.engine_user_id)
    memory.db.purge_messages(user_id=scope.engine_user_id)


def engine_ping() -> None:
    """Raise EngineError unless the engine can embed and reach its vector table."""
    from memories.engine.embedders import embedder_for, embedder_spec_active

    memory = get_memory()
    spec = embedder_spec_active()
    _call("embed", embedder_for(spec).embed, "ping", "search")
    tables = _call("list_cols", memory.vector_store.list_cols)
    if settings.MEMORY_COLLECTION not in tables:
        raise EngineError(f"vector table {settings.MEMORY_COLLECTION!r} is missing; run migrate")
    with connections["default"].cursor() as cursor:
        dims = vector_table_dims(cursor, settings.MEMORY_COLLECTION)
    if dims != spec.dims:
        raise EngineError(
            f"vector table {settings.MEMORY_COLLECTION!r} holds {dims}-d vectors but the embedder "
            f"makes {spec.dims}-d ones; re-embed (manage.py reembed)"
        )


def engine_warm_up() -> None:
    """Build this process's engine and run its local embedder once, so that the first call
    does not pay for loading them (1-2 s). A remote embedder is not called: that would bill
    a request at every start. Raises EngineError like any engine call."""
    from memories.engine.embedders import embedder_for, embedder_spec_active

    get_memory()
    spec = embedder_spec_active()
    if spec.name == "local":
        _call("embed", embedder_for(spec).embed, "warm up", "search")


def engine_llm_json(prompt: str) -> dict[str, Any]:
    """One JSON answer from the engine's LLM (issue 14's enrichment). Raises LlmUnavailable
    without an LLM and EngineError when the call fails or the answer is not a JSON object."""
    if not llm_configured():
        raise LlmUnavailable("no LLM configured")
    memory = get_memory()
    text = _call(
        "llm",
        memory.llm.generate_response,
        messages=[{"role": "user", "content": prompt}],
        response_format={"type": "json_object"},
    )
    try:
        start, end = str(text).index("{"), str(text).rindex("}") + 1
        answer = json.loads(str(text)[start:end])
    except ValueError as exc:
        raise EngineError("the LLM's answer is not JSON") from exc
    if not isinstance(answer, dict):
        raise EngineError("the LLM's answer is not a JSON object")
    return answer
