"""What every benchmark shares: its own embedded database, timing, percentiles, results."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    ordered = sorted(samples_ms)
    cuts = statistics.quantiles(ordered, n=100, method="inclusive")
    return {
        "n": len(ordered),
        "p50_ms": round(cuts[49], 2),
        "p95_ms": round(cuts[94], 2),
        "p99_ms": round(cuts[98], 2),
        "mean_ms": round(statistics.fmean(ordered), 2),
        "per_s": round(1000 / statistics.fmean(ordered), 1),
    }


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


@contextmanager
def bench_database() -> Iterator[None]:
    """Django on the benchmark's own data dir (var/bench, or DATABASE_URL), migrated;
    the embedded Postgres runs for the block's duration."""
    os.environ.setdefault("MEMSITE_DATA_DIR", str(ROOT / "var" / "bench"))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "memsite.settings")
    import django

    django.setup()
    from django.core.management import call_command

    from memsite.launcher import embedded_database_for_command

    with embedded_database_for_command():
        call_command("migrate", verbosity=0)
        try:
            yield
        finally:
            from memories.engine import engine_close

            engine_close()


def write_results(name: str, results: dict, **extra) -> None:
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(exist_ok=True)
    out = out_dir / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"benchmark": name, **extra, "results": results}, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")
