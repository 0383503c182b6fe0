"""The memory block injected into the system prompt, from a template file."""

from __future__ import annotations

import functools
from pathlib import Path

from django.conf import settings

PLACEHOLDER = "{memories}"


class TemplateProblem(Exception):
    pass


@functools.cache
def memory_template_load() -> str:
    path = Path(settings.PROXY_MEMORY_TEMPLATE_PATH)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        raise TemplateProblem(f"The chat proxy's memory template {path} is missing or unreadable.") from None
    if PLACEHOLDER not in text:
        raise TemplateProblem(f"The chat proxy's memory template {path} has no {PLACEHOLDER} placeholder.")
    return text


def memory_block_render(memories: list[str]) -> str:
    lines = "\n".join(f"- {m}" for m in memories)
    return memory_template_load().replace(PLACEHOLDER, lines)
