"""The service's Prometheus metrics, defined once for every process.

Web, worker and beat processes each write their samples to files under
`PROMETHEUS_MULTIPROC_DIR` (prometheus-client's multi-process mode, set by the
launcher before any of them starts); `/metrics` (memsite/observability.py) sums them.
Without that variable (tests in one process, `manage.py` commands) the values live in
this process only. Gauges computed from the database (outbox depth, audit export lag,
broker queue) are not here: they are collected at scrape time.

Labels hold only bounded values (operation and channel names, error codes, statuses):
never a user, a memory id or content.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import wraps

from prometheus_client import Counter, Histogram, disable_created_metrics

from core.errors import ServiceError

# `*_created` series double the exposition and no query here uses them.
disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped upstream

# One line per dispatched call (operation, channel, outcome, latency; never arguments).
call_logger = logging.getLogger("memsite.calls")

# Seconds; calls range from ~5 ms (list) to seconds (ingest with an LLM).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FAST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# --- calls (every face: MCP, REST, UI) -----------------------------------------------
CALLS = Counter(
    "memsite_calls",
    "Memory operations served, by operation, channel and outcome (ok, error, denied) and error code.",
    ["operation", "channel", "outcome", "code"],
)
CALL_SECONDS = Histogram(
    "memsite_call_duration_seconds",
    "Latency of memory operations inside the dispatcher (validation, service, engine, audit).",
    ["operation", "channel"],
    buckets=LATENCY_BUCKETS,
)
RATE_LIMITED = Counter(
    "memsite_rate_limit_rejections", "Calls refused by a per-user rate limit, by operation.", ["operation"]
)
UNAUTHENTICATED = Counter(
    "memsite_unauthenticated_requests",
    "HTTP requests answered 401 (missing or invalid credentials), by channel (mcp, oauth, rest, ui, admin, metrics).",
    ["channel"],
)

# --- engine ---------------------------------------------------------------------------
ENGINE_SECONDS = Histogram(
    "memsite_engine_duration_seconds",
    "Time in the memory engine (mem0 calls and our own vector/BM25 reads), by action and outcome.",
    ["action", "outcome"],
    buckets=FAST_BUCKETS,
)
EMBED_SECONDS = Histogram(
    "memsite_embed_duration_seconds",
    "Time to embed texts, by embedder (local, gemini) and kind (one = a query or memory, batch).",
    ["embedder", "kind"],
    buckets=FAST_BUCKETS,
)

# --- seed 002: the turn-lifecycle tools (memory_before_turn, memory_after_turn, ...) -----
# Names as the seed gives them. Calls of those operations through the dispatcher are
# counted here automatically (`call_observed`); the lifecycle services call the helpers
# below for what only they know.
TURN_BEFORE = Counter("mcp_memory_before_turn", "memory_before_turn calls by status (ok or error code).", ["status"])
TURN_AFTER = Counter("mcp_memory_after_turn", "memory_after_turn calls by status (ok or error code).", ["status"])
TURN_AFTER_MS = Histogram(
    "mcp_memory_after_turn_duration_ms",
    "memory_after_turn latency in milliseconds.",
    buckets=(5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000),
)
TURN_MAINTENANCE = Counter(
    "mcp_memory_maintenance", "memory_run_maintenance calls by status (ok or error code).", ["status"]
)
TURN_COMPACTION = Counter("mcp_memory_compaction", "Compactions run by turn maintenance.")
TURN_FACT_WRITE = Counter("mcp_memory_fact_write", "Facts written by the turn lifecycle, by tier.", ["tier"])
TURN_IDEMPOTENCY_CONFLICTS = Counter(
    "mcp_memory_idempotency_conflicts", "memory_after_turn calls refused because the same turn is in progress."
)

_TURN_STATUS_COUNTERS = {
    "memory_before_turn": TURN_BEFORE,
    "memory_after_turn": TURN_AFTER,
    "memory_run_maintenance": TURN_MAINTENANCE,
}
for _counter in _TURN_STATUS_COUNTERS.values():
    _counter.labels(status="ok")  # present (at 0) from the start, so rate() and alerts see them


def turn_compaction_record() -> None:
    TURN_COMPACTION.inc()


def turn_fact_write_record(*, tier: str, count: int = 1) -> None:
    TURN_FACT_WRITE.labels(tier=tier).inc(count)


def turn_idempotency_conflict_record() -> None:
    TURN_IDEMPOTENCY_CONFLICTS.inc()


# --- helpers ----------------------------------------------------------------------------
class CallObservation:
    """Filled in by the dispatcher: how the call ended."""

    __slots__ = ("code", "outcome")

    def __init__(self) -> None:
        self.outcome = "ok"
        self.code = ""

    def failed(self, *, code: str, denied: bool = False) -> None:
        self.outcome = "denied" if denied else "error"
        self.code = code


@contextmanager
def call_observed(*, operation: str, channel: str) -> Iterator[CallObservation]:
    """Count and time one call (the dispatcher's, or a web UI call made outside it). A
    ServiceError that escapes counts under its code (denied or error); any other exception
    without `failed` having been called counts as an error with code `unexpected`."""
    observation = CallObservation()
    started = time.perf_counter()
    try:
        yield observation
    except ServiceError as error:
        if observation.outcome == "ok":
            observation.failed(code=error.code, denied=error.denied)
        raise
    except BaseException:
        if observation.outcome == "ok":
            observation.failed(code="unexpected")
        raise
    finally:
        elapsed = time.perf_counter() - started
        CALLS.labels(operation=operation, channel=channel, outcome=observation.outcome, code=observation.code).inc()
        CALL_SECONDS.labels(operation=operation, channel=channel).observe(elapsed)
        turn_counter = _TURN_STATUS_COUNTERS.get(operation)
        if turn_counter is not None:
            turn_counter.labels(status=observation.code or "ok").inc()
        if operation == "memory_after_turn":
            TURN_AFTER_MS.observe(elapsed * 1000)
        call_logger.info(
            "call %s via %s: %s%s in %.1f ms",
            operation,
            channel,
            observation.outcome,
            f" ({observation.code})" if observation.code else "",
            elapsed * 1000,
        )


def lines_observed(*, operation: str, channel: str, start: Callable[[], Iterator[str]]) -> Iterator[str]:
    """`start()`'s lines (a streamed download or export), counted and timed as one call
    until the last of them is read. A ServiceError from `start` itself (the service's
    checks, before any line) is counted under its code and raised to the caller. Lines
    closed before their end, whether or not one was read, count as `client_gone`; an
    error while they are read, under its code."""
    observing = ExitStack()
    observation = observing.enter_context(call_observed(operation=operation, channel=channel))
    with observing:
        lines = start()
        return _ObservedLines(lines, observing=observing.pop_all(), observation=observation)


class _ObservedLines:
    # An iterator class, not a generator: a generator closed before its first line never
    # runs its body, so the observation would only end (as `unexpected`) when collected.
    def __init__(self, lines: Iterator[str], *, observing: ExitStack, observation: CallObservation) -> None:
        self._lines = lines
        self._observing: ExitStack | None = observing
        self._observation = observation

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        try:
            return next(self._lines)
        except StopIteration:
            self._end()
            raise
        except BaseException as error:
            self._end(error)
            raise

    def close(self) -> None:
        if self._observing is None:
            return
        self._observation.failed(code="client_gone")
        try:
            close = getattr(self._lines, "close", None)
            if close is not None:
                close()
        finally:
            self._end()

    def _end(self, error: BaseException | None = None) -> None:
        observing, self._observing = self._observing, None
        if observing is not None:
            observing.__exit__(type(error) if error else None, error, error.__traceback__ if error else None)


def rate_limit_rejection_record(*, operation: str) -> None:
    RATE_LIMITED.labels(operation=operation).inc()


def unauthenticated_record(*, channel: str) -> None:
    UNAUTHENTICATED.labels(channel=channel).inc()


@contextmanager
def engine_timed(action: str) -> Iterator[None]:
    started = time.perf_counter()
    outcome = "error"
    try:
        yield
        outcome = "ok"
    finally:
        ENGINE_SECONDS.labels(action=action, outcome=outcome).observe(time.perf_counter() - started)


def engine_timed_function[**P, R](action: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator form of `engine_timed`."""

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @wraps(fn)
        def timed(*args: P.args, **kwargs: P.kwargs) -> R:
            with engine_timed(action):
                return fn(*args, **kwargs)

        return timed

    return decorate


def embedder_timed[**P, R](fn: Callable[P, R], *, embedder: str, kind: str) -> Callable[P, R]:
    """`fn` (an embedder's embed or embed_batch), timed."""

    @wraps(fn)
    def timed(*args: P.args, **kwargs: P.kwargs) -> R:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            EMBED_SECONDS.labels(embedder=embedder, kind=kind).observe(time.perf_counter() - started)

    return timed
