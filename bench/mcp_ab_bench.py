"""MCP `remember` and `search_memory` of this checkout against another one, call by call.

Both servers run at once, each on its own embedded database under `var/bench-ab/`, each
checkout with its own `.venv` (run `bin/serve` there once to create it). One official-SDK
client per server fills both with the same memories, then makes the same calls on both,
in a random order within each pair, so that both sides see the same machine noise. Prints
p50/p95 of each side and the median of the per-pair ratios; writes JSON to bench/results/.

    git worktree add ../memsite-base <commit>
    bench/run mcp_ab --base ../memsite-base [--fill 1000] [--calls 300]

The other checkout must have `bench/mcp_bench.py` and `bench/common.py` (every commit
since issue 3).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, percentiles, write_results
from bench.engine_bench import synthetic_fact, synthetic_query

# Run by each checkout's own Python in its own directory: its database, a key, its server.
SERVE = """
import json, os, signal, sys, time
sys.path.insert(0, os.getcwd())
from bench.common import bench_database
from bench.mcp_bench import RATE_LIMITS_OFF, _free_port, start_server
ready, stop, username = sys.argv[1], sys.argv[2], sys.argv[3]
with bench_database():
    from django.contrib.auth import get_user_model
    from memories.services import api_key_issue
    user, _ = get_user_model().objects.get_or_create(username=username)
    token = api_key_issue(user=user, name="bench-ab")[1]
    os.environ.update(RATE_LIMITS_OFF)
    port = _free_port()
    server = start_server(port)
    try:
        with open(ready + ".tmp", "w") as out:
            json.dump({"url": f"http://127.0.0.1:{port}/engines/memory/mcp", "token": token}, out)
        os.replace(ready + ".tmp", ready)
        while not os.path.exists(stop):
            time.sleep(0.2)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
"""


def _start(checkout: Path, side: str, workdir: Path) -> tuple[subprocess.Popen, Path]:
    python = checkout / ".venv" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{checkout} has no .venv: run bin/test --version there first")
    ready = workdir / f"{side}.json"
    env_dir = ROOT / "var" / "bench-ab" / side
    process = subprocess.Popen(
        # A new user per run: both sides start from no memories, whatever earlier runs left.
        [str(python), "-c", SERVE, str(ready), str(workdir / "stop"), f"bench-mcp-ab-{int(time.time())}"],
        cwd=checkout,
        env={**os.environ, "MEMSITE_DATA_DIR": str(env_dir)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return process, ready


def _wait_ready(ready: Path, process: subprocess.Popen) -> dict:
    deadline = time.monotonic() + 300
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server for {ready.stem} did not start")
        time.sleep(0.5)
    return json.loads(ready.read_text())


async def _run(servers: dict[str, dict], fill: int, calls: int) -> dict:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {servers['base']['token']}"}, timeout=120) as http_base,
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {servers['this']['token']}"}, timeout=120) as http_this,
        Client(streamable_http_client(servers["base"]["url"], http_client=http_base), mode="legacy") as base,
        Client(streamable_http_client(servers["this"]["url"], http_client=http_this), mode="legacy") as this,
    ):
        clients = {"base": base, "this": this}
        fill_rng = random.Random(5)
        for n in range(fill):
            fact = synthetic_fact(fill_rng, n)
            await asyncio.gather(*(client.call_tool("remember", {"memory": fact}) for client in clients.values()))
        latencies: dict[str, dict[str, list[float]]] = {op: {"base": [], "this": []} for op in ("remember", "search")}
        rng = random.Random(11)
        for n in range(calls):
            pairs = (
                ("remember", "remember", {"memory": synthetic_fact(rng, fill + n)}),
                ("search", "search_memory", {"query": synthetic_query(rng), "top_k": 10}),
            )
            for op, tool, arguments in pairs:
                order = ["base", "this"]
                rng.shuffle(order)
                for side in order:
                    started = time.perf_counter()
                    result = await clients[side].call_tool(tool, arguments)
                    latencies[op][side].append((time.perf_counter() - started) * 1000)
                    if result.is_error:
                        error = result.content[0].text if result.content else None
                        raise SystemExit(f"{tool} failed on {side}: {error}")
    results = {}
    for op, sides in latencies.items():
        ratios = [this / base for base, this in zip(sides["base"], sides["this"], strict=True)]
        results[op] = {
            "base": percentiles(sides["base"]),
            "this": percentiles(sides["this"]),
            "p50_ratio": round(percentiles(sides["this"])["p50_ms"] / percentiles(sides["base"])["p50_ms"], 3),
            "median_pair_ratio": round(statistics.median(ratios), 3),
        }
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the other checkout (with its own .venv)")
    parser.add_argument("--fill", type=int, default=1000, help="memories stored on each side first")
    parser.add_argument("--calls", type=int, default=300, help="timed pairs per operation")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        started = [_start(args.base.resolve(), "base", workdir), _start(ROOT, "this", workdir)]
        try:
            servers = {
                side: _wait_ready(ready, process)
                for side, (process, ready) in zip(("base", "this"), started, strict=True)
            }
            results = asyncio.run(_run(servers, args.fill, args.calls))
        finally:
            (workdir / "stop").touch()
            for process, _ in started:
                process.wait(60)
    for op, figures in results.items():
        print(
            f"{op:<8} base p50 {figures['base']['p50_ms']:6.2f} p95 {figures['base']['p95_ms']:6.2f}"
            f" | this p50 {figures['this']['p50_ms']:6.2f} p95 {figures['this']['p95_ms']:6.2f}"
            f" | this/base p50 {figures['p50_ratio']:.3f}, median of pairs {figures['median_pair_ratio']:.3f}"
        )
    write_results("mcp_ab", results, base=str(args.base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
