"""Streamed downloads from the web UI, which runs on Django's ASGI handler.

Under ASGI, Django reads a sync streaming iterator whole before it sends a byte
(`sync_to_async(list)`, with a warning), so a large download would sit in the web
process's memory. An async iterator is sent as it is produced. `streaming_download` gives
Django one that reads the sync lines in batches on the request's own thread
(`thread_sensitive`: the thread, and so the database connection, the view used), so one
batch at a time is held. Under WSGI (Django's test client) the lines go as they are.

`download_observed` counts and times a download as one call in the metrics
(`core.metrics.call_observed`, channel `ui`), as the dispatcher does the UI's other
calls: from the service's checks to the last line, a refusal under its code, a client
that went away as `client_gone`."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, StreamingHttpResponse

from core.choices import Channel
from core.metrics import CallObservation, call_observed

DOWNLOAD_BATCH_LINES = 500


def streaming_download(
    request: HttpRequest, lines: Iterator[str], *, content_type: str, filename: str
) -> StreamingHttpResponse:
    content = _in_batches(lines) if isinstance(request, ASGIRequest) else lines
    response = StreamingHttpResponse(content, content_type=content_type)
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


def download_observed(*, operation: str, start: Callable[[], Iterator[str]]) -> Iterator[str]:
    """`start()`'s lines, observed as one call until the last of them. A ServiceError
    from `start` (the service's checks, before the first line) is counted and raised for
    the view to answer."""
    with ExitStack() as stack:
        observation = stack.enter_context(call_observed(operation=operation, channel=Channel.UI))
        lines = start()
        observing = stack.pop_all()
    return _observed_lines(lines, observing=observing, observation=observation)


def _observed_lines(lines: Iterator[str], *, observing: ExitStack, observation: CallObservation) -> Iterator[str]:
    with observing:
        try:
            yield from lines
        except GeneratorExit:  # closed before its end: the client went away
            observation.failed(code="client_gone")
            raise


async def _in_batches(lines: Iterator[str]) -> AsyncIterator[str]:
    def batch() -> str:
        return "".join(itertools.islice(lines, DOWNLOAD_BATCH_LINES))

    take = sync_to_async(batch, thread_sensitive=True)
    try:
        while text := await take():
            yield text
    finally:
        # A client that went away: the lines' open cursors are closed on their thread.
        close = getattr(lines, "close", None)
        if close is not None:
            await sync_to_async(close, thread_sensitive=True)()
