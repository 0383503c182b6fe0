"""Celery tasks of the chat proxy: thin callers of proxy.services."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="proxy.turn_extract", ignore_result=True)
def turn_extract(turn_pk: int) -> str:
    from proxy.services import proxy_turn_extract

    return proxy_turn_extract(turn_pk=turn_pk)


@shared_task(name="proxy.turns_sweep", ignore_result=True)
def turns_sweep() -> int:
    from proxy.services import proxy_turns_sweep

    return proxy_turns_sweep()


@shared_task(name="proxy.turns_prune", ignore_result=True)
def turns_prune() -> int:
    from proxy.services import proxy_turns_prune

    return proxy_turns_prune()
