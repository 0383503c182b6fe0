"""Export and import throughput for one user (issue 17): `memory_export` (JSONL and
Markdown) of a user with N memories, the web UI's streamed download of the same file
(`memory_export_stream`, every line read and dropped), the peak of Python memory each
export allocates (tracemalloc, one extra run each), then `memory_import_file` of that JSONL into an empty
user (embeds every text, then one transaction), then the same import again (every text
already there: nothing written). In-process, the same services `manage.py
export_memories` / `import_memories`, the REST routes and the web UI call.

    bench/run portability [--memories 10000] [--runs 3]

The source user is bench/run search's first filler user (its rows are inserted straight
into the engine's table); the import's target user is erased after each run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc

from bench.common import bench_database, write_results
from bench.search_bench import fill


def _call():
    from core.scope import CallContext

    return CallContext(channel="internal")  # one per billed call: each has its own request id


def _seconds(fn) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def _peak_mb(fn) -> float:
    """The most Python memory `fn` held at once, in MiB (tracemalloc slows it: not timed)."""
    tracemalloc.start()
    try:
        fn()
        return round(tracemalloc.get_traced_memory()[1] / 2**20, 1)
    finally:
        tracemalloc.stop()


def run(memories: int, runs: int) -> dict:
    from django.conf import settings
    from django.contrib.auth import get_user_model

    from core.scope import MemoryScope
    from memories.services import memory_export, memory_export_stream, memory_import_file
    from memories.toolkit.services import toolkit_user_data_wipe

    settings.RATE_LIMITS = {op: (0, 60) for op in settings.RATE_LIMITS}
    settings.IMPORT_MAX_MEMORIES = max(settings.IMPORT_MAX_MEMORIES, memories)
    settings.IMPORT_MAX_BYTES = max(settings.IMPORT_MAX_BYTES, memories * 2000)
    source = fill(1, memories)[0]
    target_user, _ = get_user_model().objects.get_or_create(username="bench-portability-target")
    target = MemoryScope.for_user(target_user, client_app="bench")
    figures: dict[str, list[float]] = {
        "export_jsonl": [],
        "export_markdown": [],
        "export_jsonl_streamed": [],
        "import": [],
        "reimport": [],
    }

    def streamed() -> int:
        return sum(len(line) for line in memory_export_stream(source, file_format="jsonl", call=_call()))

    size = 0
    for n in range(runs):
        toolkit_user_data_wipe(target, confirm=True, call=_call())
        seconds, exported = _seconds(lambda: memory_export(source, file_format="jsonl", call=_call()))
        figures["export_jsonl"].append(seconds)
        size = len(exported.content.encode())
        seconds, _ = _seconds(lambda: memory_export(source, file_format="markdown", call=_call()))
        figures["export_markdown"].append(seconds)
        seconds, _ = _seconds(streamed)
        figures["export_jsonl_streamed"].append(seconds)
        data = exported.content.encode()
        seconds, imported = _seconds(lambda d=data: memory_import_file(target, data=d, source="memsite", call=_call()))
        figures["import"].append(seconds)
        if imported.imported != exported.count:
            raise SystemExit(f"imported {imported.imported} of {exported.count}")
        seconds, again = _seconds(lambda d=data: memory_import_file(target, data=d, source="memsite", call=_call()))
        figures["reimport"].append(seconds)
        if again.imported != 0:
            raise SystemExit(f"the re-import added {again.imported}")
        print(f"  run {n + 1}/{runs}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in figures.items()), file=sys.stderr)
    toolkit_user_data_wipe(target, confirm=True, call=_call())
    peak = {
        "built_jsonl": _peak_mb(lambda: memory_export(source, file_format="jsonl", call=_call())),
        "streamed_jsonl": _peak_mb(streamed),
    }
    return {
        "memories": memories,
        "jsonl_bytes": size,
        "python_peak_mib": peak,
        **{
            name: {"median_s": round(statistics.median(v), 2), "memories_per_s": round(memories / statistics.median(v))}
            for name, v in figures.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memories", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with bench_database():
        results = run(args.memories, args.runs)
    for name, value in results.items():
        print(f"{name:16} {value}")
    write_results("portability", results)


if __name__ == "__main__":
    main()
