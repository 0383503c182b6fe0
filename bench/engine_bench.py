"""Engine add and search latency for one user at 1k and 10k memories.

Runs the real engine (mem0 in-process, pgvector exact scan, MiniLM ONNX embedder) on
its own embedded database under var/bench (or DATABASE_URL). Prints p50/p95/p99 and
throughput; writes JSON to bench/results/.

    bench/run engine [--sizes 1000 10000] [--queries 200]
"""

from __future__ import annotations

import argparse
import random
import sys

from bench.common import bench_database, percentiles, timed, write_results

SUBJECTS = ["my sister", "our landlord", "the dentist", "my manager", "the kids", "grandma", "my friend Tom", "the vet"]
VERBS = ["booked", "cancelled", "moved", "paid for", "forgot", "asked about", "recommended", "complained about"]
OBJECTS = [
    "the flight to Lisbon", "a table at the Thai place", "the piano lessons", "the car insurance",
    "the hiking trip", "a new laptop", "the electricity bill", "tickets for the concert", "the yoga class",
    "the birthday party", "a vegetarian cookbook", "the broken dishwasher",
]  # fmt: skip
WHEN = ["on Monday", "last week", "in March", "yesterday", "for next summer", "twice this month", "at 7pm"]


def synthetic_fact(rng: random.Random, i: int) -> str:
    return f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(WHEN)} (#{i})"


def synthetic_query(rng: random.Random) -> str:
    return f"what did {rng.choice(SUBJECTS)} do about {rng.choice(OBJECTS)}?"


def run(sizes: list[int], queries: int, add_samples: int) -> dict:
    from core.scope import MemoryScope
    from memories import engine

    scope = MemoryScope(tenant="bench", user_pk=1)
    engine.engine_purge_user(scope)
    rng = random.Random(42)
    stored = 0
    results = {}
    for size in sorted(sizes):
        add_ms = []
        while stored < size:
            text = synthetic_fact(rng, stored)
            elapsed = timed(lambda text=text: engine.engine_add_text(scope, text=text))
            stored += 1
            if size - stored < add_samples:
                add_ms.append(elapsed)
            if stored % 1000 == 0:
                print(f"  stored {stored}", file=sys.stderr)
        search_ms = [
            timed(lambda q=synthetic_query(rng): engine.engine_search(scope, query=q, top_k=10)) for _ in range(queries)
        ]
        results[str(size)] = {"add": percentiles(add_ms), "search": percentiles(search_ms)}
        print(f"{size:>6} memories  add    {results[str(size)]['add']}")
        print(f"{size:>6} memories  search {results[str(size)]['search']}")
    engine.engine_purge_user(scope)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--add-samples", type=int, default=200, help="adds timed just before each size")
    args = parser.parse_args()

    with bench_database():
        results = run(args.sizes, args.queries, args.add_samples)
    write_results("engine", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
