"""Shared by export_memories and import_memories: the named user's scope and an operator call."""

from __future__ import annotations

import sys

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from core.choices import Channel
from core.scope import CallContext, MemoryScope

CLI_CLIENT_APP = "manage.py"


def operator_scope(username: str) -> tuple[MemoryScope, CallContext]:
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise CommandError(f"no user {username!r}")
    scope = MemoryScope.for_user(user, client_app=CLI_CLIENT_APP)
    return scope, CallContext(channel=Channel.INTERNAL, actor_username=username, actor_auth="operator")


class ProgressLine:
    """`label: done/total noun` on stderr each time `done` passes a multiple of `every`,
    and at the end. Passes, not hits: the work reports in batches (64 texts embedded at a
    time), so `done` seldom lands on a multiple of `every` itself. `say` adds the lines
    that tell which phase a long run is in."""

    def __init__(self, label: str, *, noun: str = "", stream=None, every: int = 100) -> None:
        self.label, self.noun, self.stream, self.every = label, noun, stream or sys.stderr, every
        self._step = 0

    def say(self, text: str) -> None:
        self.stream.write(f"{self.label}: {text}\n")
        self.stream.flush()

    def __call__(self, done: int, total: int) -> None:
        step = done // self.every
        if step != self._step or (total and done == total):
            self._step = step
            self.say(f"{done}/{total or '?'} {self.noun}".rstrip())


class ImportProgress(ProgressLine):
    """The import's new texts embedded, then the one write transaction that follows."""

    def __init__(self, stream=None, every: int = 100) -> None:
        super().__init__("import", noun="new texts embedded", stream=stream, every=every)

    def __call__(self, done: int, total: int) -> None:
        if total:
            super().__call__(done, total)
        else:  # every text is known already (a re-import): nothing to embed
            self.say("no new texts to embed")
        if done == total:
            self.say("writing the new memories (one transaction)")
