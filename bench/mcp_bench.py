"""MCP `remember` and `search_memory` over HTTP, at 1k and 10k memories for one user,
with 1 and 8 concurrent clients (official `mcp` SDK client, one session per client).

Starts its own embedded database under var/bench (or uses DATABASE_URL) and its own
uvicorn process with rate limits off. Prints p50/p95/p99 and requests/s; writes JSON
to bench/results/.

    bench/run mcp [--sizes 1000 10000] [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time

from bench.common import ROOT, bench_database, percentiles, write_results
from bench.engine_bench import synthetic_fact, synthetic_query

RATE_LIMITS_OFF = {f"RATE_LIMIT_{op}": "0" for op in ("REMEMBER", "SEARCH_MEMORY", "CLEAR_ALL_MEMORY")}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    env = {**os.environ, **RATE_LIMITS_OFF}
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "memsite.asgi:application", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return process
        except OSError:
            time.sleep(0.2)
    raise SystemExit("uvicorn did not start")


class Clients:
    def __init__(self, url: str, token: str, count: int):
        self.url, self.token, self.count = url, token, count

    async def run(self, make_call, calls: int) -> tuple[list[float], float]:
        """`calls` tool calls spread over `count` concurrent sessions: latencies (ms), wall time (s)."""
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        latencies: list[float] = []
        per_client = [calls // self.count + (1 if i < calls % self.count else 0) for i in range(self.count)]

        async def one_client(n: int) -> None:
            headers = {"Authorization": f"Bearer {self.token}"}
            async with (
                httpx2.AsyncClient(headers=headers, timeout=120) as http,
                Client(streamable_http_client(self.url, http_client=http), mode="legacy") as client,
            ):
                for _ in range(n):
                    name, arguments = make_call()
                    started = time.perf_counter()
                    result = await client.call_tool(name, arguments)
                    latencies.append((time.perf_counter() - started) * 1000)
                    if result.is_error:
                        raise SystemExit(f"{name} failed: {result.content[0].text if result.content else None}")

        started = time.perf_counter()
        await asyncio.gather(*(one_client(n) for n in per_client if n))
        return latencies, time.perf_counter() - started


def _summary(latencies: list[float], wall_s: float) -> dict:
    return {**percentiles(latencies), "requests_per_s": round(len(latencies) / wall_s, 1)}


def run(url: str, token: str, sizes: list[int], calls: int) -> dict:
    rng = random.Random(7)
    counter = iter(range(10**9))

    def remember():
        return "remember", {"memory": synthetic_fact(rng, next(counter))}

    def search():
        return "search_memory", {"query": synthetic_query(rng), "top_k": 10}

    results: dict = {}
    stored = 0
    for size in sorted(sizes):
        fill = size - stored - 2 * calls
        if fill > 0:
            asyncio.run(Clients(url, token, 8).run(remember, fill))
            stored += fill
            print(f"  filled to {stored}", file=sys.stderr)
        row = {}
        for concurrency in (1, 8):
            row[f"remember_c{concurrency}"] = _summary(
                *asyncio.run(Clients(url, token, concurrency).run(remember, calls))
            )
            stored += calls
        for concurrency in (1, 8):
            row[f"search_c{concurrency}"] = _summary(*asyncio.run(Clients(url, token, concurrency).run(search, calls)))
        results[str(stored)] = row
        for name, figures in row.items():
            print(f"{stored:>6} memories  {name:<12} {figures}")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--calls", type=int, default=200, help="timed calls per figure")
    args = parser.parse_args()

    with bench_database():
        from django.contrib.auth import get_user_model

        from core.scope import MemoryScope
        from memories.services import api_key_issue

        user, _ = get_user_model().objects.get_or_create(username="bench-mcp")
        token = api_key_issue(user=user, name="bench")[1]
        os.environ.update(RATE_LIMITS_OFF)
        scope = MemoryScope.for_user(user)
        port = _free_port()
        server = start_server(port)
        try:
            _clear(scope)
            results = run(f"http://127.0.0.1:{port}/engines/memory/mcp", token, args.sizes, args.calls)
            _clear(scope)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)
    write_results("mcp", results)
    return 0


def _clear(scope) -> None:
    """Empty the bench user, trash included: every run would otherwise leave its 10,000
    memories in the trash (kept TRASH_RETENTION_DAYS), and the next run's searches would
    wade through them (measured: search c1 p50 22 -> 64 ms with 50,000 trashed rows of the
    same texts)."""
    from django.conf import settings

    from core.scope import CallContext
    from memories.services import memory_clear_all, memory_purge

    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "clear_all_memory": (0, 3600)}
    memory_clear_all(scope, confirm=True, call=CallContext(channel="internal"))
    purged = memory_purge(scope, call=CallContext(channel="internal"))
    print(f"  cleared the bench user ({purged} memories purged from the trash)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
