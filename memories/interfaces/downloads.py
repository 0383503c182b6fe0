"""Streamed downloads (the web UI's and REST's exports), under Django's ASGI handler.

Under ASGI, Django reads a sync streaming iterator whole before it sends a byte
(`sync_to_async(list)`, with a warning), so a large download would sit in the web
process's memory. An async iterator is sent as it is produced. `streaming_download` gives
Django one that reads the sync lines in batches on the request's own thread
(`thread_sensitive`: the thread, and so the database connection, the view used), so one
batch at a time is held. Under WSGI (Django's test client) the lines go as they are.

A download is counted and timed as one call until its last line by
`core.metrics.lines_observed` (the caller wraps its lines in it).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, StreamingHttpResponse

DOWNLOAD_BATCH_LINES = 500
# A memory export's file, by format: its content type and the name it is saved under.
EXPORT_DOWNLOADS = {"jsonl": ("application/x-ndjson", "memories.jsonl"), "markdown": ("text/markdown", "memories.md")}


def streaming_download(
    request: HttpRequest, lines: Iterator[str], *, content_type: str, filename: str
) -> StreamingHttpResponse:
    content = _in_batches(lines) if isinstance(request, ASGIRequest) else lines
    response = StreamingHttpResponse(content, content_type=content_type)
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


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
