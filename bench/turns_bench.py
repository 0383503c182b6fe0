"""memory_before_turn and memory_after_turn over MCP (issue 13): p50/p95/p99 at 10k
memories for the user, no LLM (rule-based extraction), official `mcp` SDK client.

Each timed turn is a before_turn (recall + the session's recent context) then an
after_turn (session log append, one extracted fact embedded and stored, guard, audit row
and usage event), in sessions of 10 turns. Seed 002's targets: p95 < 300 ms and < 500 ms.

    bench/run turns [--memories 10000] [--turns 200] [--concurrency 1 4]

The 10k filler memories are inserted straight into the engine's table (as bench/run
search does); uvicorn runs in its own process with rate limits off.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import time

from bench.common import bench_database, percentiles, write_results
from bench.engine_bench import synthetic_query
from bench.mcp_bench import _free_port

RATE_LIMITS_OFF = {f"RATE_LIMIT_MEMORY_{op}": "0" for op in ("BEFORE_TURN", "AFTER_TURN")}
SUBJECTS = ("tea", "rust", "hiking", "jazz", "chess", "sailing", "ramen", "linux", "cycling", "poetry")


def _message(role: str, text: str) -> dict:
    kind = "input_text" if role == "user" else "output_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


async def _client_turns(url: str, token: str, client_no: int, turns: int, before: list, after: list) -> None:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    rng = random.Random(client_no)
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=120) as http,
        Client(streamable_http_client(url, http_client=http), mode="legacy") as client,
    ):
        session = ""
        for n in range(turns):
            if n % 10 == 0:  # a new session every 10 turns
                session = f"bench-{client_no}-{n // 10}-{time.time_ns()}"
            said = f"I prefer {rng.choice(SUBJECTS)} number {client_no}-{n}. {synthetic_query(rng)}"
            arguments = {"session_id": session, "turn_id": f"t{n}", "current_input": [_message("user", said)]}
            started = time.perf_counter()
            result = await client.call_tool("memory_before_turn", arguments)
            before.append((time.perf_counter() - started) * 1000)
            if result.is_error:
                raise SystemExit(f"before_turn failed: {result.content[0].text if result.content else None}")
            arguments = {
                "session_id": session,
                "turn_id": f"t{n}",
                "input_items": [_message("user", said)],
                "output_items": [_message("assistant", f"Noted, answer {n}.")],
            }
            started = time.perf_counter()
            result = await client.call_tool("memory_after_turn", arguments)
            after.append((time.perf_counter() - started) * 1000)
            if result.is_error:
                raise SystemExit(f"after_turn failed: {result.content[0].text if result.content else None}")


def run(url: str, token: str, turns: int, concurrency: int) -> dict:
    before: list[float] = []
    after: list[float] = []
    per_client = [turns // concurrency + (1 if i < turns % concurrency else 0) for i in range(concurrency)]

    async def all_clients() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(_client_turns(url, token, i, n, before, after) for i, n in enumerate(per_client) if n))
        return time.perf_counter() - started

    wall = asyncio.run(all_clients())
    return {
        "before_turn": percentiles(before),
        "after_turn": percentiles(after),
        "turns_per_s": round(len(after) / wall, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memories", type=int, default=10000)
    parser.add_argument("--turns", type=int, default=200, help="timed turns per concurrency level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    os.environ.update(RATE_LIMITS_OFF)
    with bench_database():
        from bench.mcp_bench import start_server
        from bench.search_bench import fill
        from memories.services import api_key_issue

        scope = fill(1, args.memories)[0]
        from django.contrib.auth import get_user_model

        user = get_user_model().objects.get(pk=scope.user_pk)
        token = api_key_issue(user=user, name="bench-turns")[1]
        port = _free_port()
        server = start_server(port)
        results = {}
        try:
            url = f"http://127.0.0.1:{port}/engines/memory-lifecycle/mcp"
            run(url, token, 5, 1)  # warm-up (model load, first connections), not reported
            for concurrency in args.concurrency:
                print(f"  {args.turns} turns, {concurrency} concurrent client(s)", file=sys.stderr)
                results[f"c{concurrency}"] = row = run(url, token, args.turns, concurrency)
                print(f"{args.memories} memories  c{concurrency}  {row}")
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)
            _cleanup(scope)
    write_results("turns", results, memories=args.memories, llm=False, cpus=os.cpu_count(), load=os.getloadavg())
    return 0


def _cleanup(scope) -> None:
    """Drop the benchmark's turn facts and session rows (the 10k fillers stay for re-runs)."""
    from django.db import connection

    from memories.models import ContentHash, SessionEvent, SessionState, TurnGuard

    owned = {"engine_user_id": scope.engine_user_id}
    for model in (SessionEvent, SessionState, TurnGuard, ContentHash):
        model.objects.filter(**owned).delete()
    from django.conf import settings

    with connection.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {settings.MEMORY_COLLECTION} WHERE payload->>'user_id' = %s AND payload->>'source' = 'after_turn'",  # noqa: S608,E501
            [scope.engine_user_id],
        )


if __name__ == "__main__":
    sys.exit(main())
