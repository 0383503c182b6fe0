"""Switching the embedder online (issue 17): the service behind `manage.py reembed`.

Search keeps answering from the old vectors while the new ones are filled in; the
switch is one short transaction; a killed run resumes where it stopped. See
`memories/engine/reembed.py` for the mechanics and docs/operations.md for the runbook."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings

from core.errors import ErrorCode, ServiceError
from memories.engine import (
    EmbedderSpec,
    ReembedBusy,
    ReembedError,
    ReembedProgress,
    engine_reembed_abort,
    engine_reembed_begin,
    engine_reembed_fill,
    engine_reembed_progress,
    engine_reembed_switch,
)

EMBEDDER_NAMES = ("local", "gemini")
LOCAL_DIMS = 384
MAX_DIMS = 16000  # pgvector's limit for a vector column
SWITCH_ATTEMPTS = 6  # switches tried, each after a fill, before the writes are said to win
# A switch that lost to writes is transient, not a conflict (which says: do not retry).
# The run it asks for fills again before it switches: that is its real wait.
SWITCH_RETRY_AFTER_S = 1


def embedder_target(*, name: str, dims: int | None) -> EmbedderSpec:
    if name not in EMBEDDER_NAMES:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"embedder must be one of {', '.join(EMBEDDER_NAMES)}")
    if name == "local":
        if dims not in (None, LOCAL_DIMS):
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"the local embedder makes {LOCAL_DIMS}-d vectors")
        return EmbedderSpec("local", LOCAL_DIMS)
    if not settings.GOOGLE_API_KEY:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "the gemini embedder needs GOOGLE_API_KEY")
    dims = settings.GEMINI_EMBEDDING_DIMS if dims is None else dims
    if not 1 <= dims <= MAX_DIMS:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"dimensions must be between 1 and {MAX_DIMS}")
    return EmbedderSpec("gemini", dims)


def embedder_reembed(
    *,
    target: EmbedderSpec,
    batch: int = 64,
    switch: bool = True,
    progress: Callable[[ReembedProgress], None] | None = None,
) -> ReembedProgress:
    """Fill the new vectors (resuming a run that was killed) and, with `switch`, make
    them the ones search uses. Idempotent: on the target already, it does nothing.

    `resource_busy` when writes keep coming faster than the switch can take them (every
    attempt found more late rows than it embeds while writes wait): what was filled is
    kept, and running again resumes. `conflict` when the recorded state forbids it (a
    re-embedding to another target under way, or this one aborted meanwhile): not a wait
    that retrying outlasts."""
    try:
        if not engine_reembed_begin(target):
            return engine_reembed_progress()
        engine_reembed_fill(batch=batch, progress=progress)
        if not switch:
            return engine_reembed_progress()
        for _attempt in range(SWITCH_ATTEMPTS - 1):  # writes keep coming: fill the late rows, then switch
            try:
                return engine_reembed_switch()
            except ReembedBusy:
                engine_reembed_fill(batch=batch, progress=progress)
        return engine_reembed_switch()
    except ReembedBusy:
        raise ServiceError(
            ErrorCode.RESOURCE_BUSY,
            f"writes kept coming faster than the switch could take them ({SWITCH_ATTEMPTS} tries, each after a "
            "fill); the new vectors filled so far are kept: run the command again to resume and switch "
            "(at a quieter time if this repeats)",
            retry_after_s=SWITCH_RETRY_AFTER_S,
        ) from None
    except ReembedError as exc:
        raise ServiceError(ErrorCode.CONFLICT, str(exc)) from None


def embedder_reembed_abort() -> ReembedProgress:
    engine_reembed_abort()
    return engine_reembed_progress()


def embedder_reembed_status() -> ReembedProgress:
    return engine_reembed_progress()
