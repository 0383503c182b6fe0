"""The chat proxy's added latency (issue 15): the same chat request sent straight to a
fake OpenAI-compatible upstream on loopback and through our /v1/chat/completions
(history, hybrid search over the user's 10k memories, injection, forward, record),
alternating, in the same run. Non-streaming: total time. Streaming: time to first byte.

    bench/run proxy [--per-user 10000] [--requests 200]

The proxy is uvicorn serving memsite.asgi in a thread of this process (one event loop,
as one web worker). The memories are bench/search_bench's filler rows.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from bench.common import bench_database, percentiles, write_results
from bench.engine_bench import synthetic_query


def _serve(port: int):
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config("memsite.asgi:application", host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("proxy server did not start")
        time.sleep(0.1)
    return server, thread


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(per_user: int, requests: int) -> dict:
    import httpx
    from django.conf import settings

    from bench.search_bench import fill
    from memories.services import api_key_issue
    from tests.fakes import FakeChatUpstream

    scope = fill(1, per_user)[0]
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.get(pk=scope.user_pk)
    key = api_key_issue(user=user, name="bench-proxy")[1]
    upstream = FakeChatUpstream().start()
    settings.CHAT_UPSTREAM_BASE_URL = upstream.url
    settings.CHAT_UPSTREAM_API_KEY = "bench"
    settings.RATE_LIMITS = {op: (0, 60) for op in settings.RATE_LIMITS}
    port = _free_port()
    server, thread = _serve(port)
    proxy_url = f"http://127.0.0.1:{port}/v1/chat/completions"
    direct_url = f"{upstream.url}/v1/chat/completions"
    import random

    rng = random.Random(7)
    samples: dict[str, list[float]] = {"direct": [], "proxy": [], "direct_ttfb": [], "proxy_ttfb": []}
    added: dict[str, list[float]] = {"total": [], "ttfb": []}
    with httpx.Client(timeout=60) as client:

        def once(url: str, *, stream: bool, session: str) -> float:
            body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": synthetic_query(rng)}]}
            headers = {"Authorization": f"Bearer {key}", "X-Session-Id": session}
            started = time.perf_counter()
            with client.stream("POST", url, json=body, headers=headers) as response:
                chunks = response.iter_raw()
                next(chunks)
                first = time.perf_counter() - started
                for _ in chunks:
                    pass
            total = time.perf_counter() - started
            assert response.status_code == 200, response.status_code
            return (first if stream else total) * 1000

        for n in range(10):  # warm up: engine, connections, caches
            once(proxy_url, stream=n % 2 == 0, session="warm")
        for n in range(requests):
            session = f"s{n // 10}"  # sessions of 10 turns: the history grows as in use
            pair = [("direct", direct_url), ("proxy", proxy_url)]
            for stream, suffix in ((False, ""), (True, "_ttfb")):
                got = {}
                for name, url in pair if n % 2 == 0 else reversed(pair):
                    got[name] = once(url, stream=stream, session=session)
                    samples[name + suffix].append(got[name])
                added["ttfb" if stream else "total"].append(got["proxy"] - got["direct"])
            if (n + 1) % 50 == 0:
                print(f"  {n + 1}/{requests} requests", file=sys.stderr)
    server.should_exit = True
    thread.join(15)
    upstream.stop()
    results = {
        "memories_for_user": per_user,
        "non_streaming_direct": percentiles(samples["direct"]),
        "non_streaming_proxy": percentiles(samples["proxy"]),
        "non_streaming_added_per_pair": percentiles(added["total"]),
        "streaming_ttfb_direct": percentiles(samples["direct_ttfb"]),
        "streaming_ttfb_proxy": percentiles(samples["proxy_ttfb"]),
        "streaming_ttfb_added_per_pair": percentiles(added["ttfb"]),
    }
    for kind, direct, proxied in (
        ("non_streaming", "non_streaming_direct", "non_streaming_proxy"),
        ("streaming_ttfb", "streaming_ttfb_direct", "streaming_ttfb_proxy"),
    ):
        results[f"{kind}_added_ms"] = {
            q: round(results[proxied][f"{q}_ms"] - results[direct][f"{q}_ms"], 2) for q in ("p50", "p95")
        }
    for name, figures in results.items():
        print(f"{name:<32} {figures}")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-user", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    with bench_database():
        results = run(args.per_user, args.requests)
    write_results("proxy", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
