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
    """`done/total` on stderr, at most every `every` items (and at the end)."""

    def __init__(self, label: str, stream=None, every: int = 100) -> None:
        self.label, self.stream, self.every = label, stream or sys.stderr, every

    def __call__(self, done: int, total: int) -> None:
        if done % self.every == 0 or (total and done == total):
            self.stream.write(f"{self.label}: {done}/{total or '?'}\n")
            self.stream.flush()
