"""What recording a usage event adds to a call: the outbox insert in the call's
transaction, plus the on-commit enqueue of the delivery task (Postgres broker).

    bench/run billing [--calls 1000]
"""

from __future__ import annotations

import argparse
import sys

from bench.common import bench_database, percentiles, timed, write_results


def run(calls: int) -> dict:
    from django.db import transaction

    from billing.models import UsageEvent
    from billing.services import usage_event_record
    from core.scope import CallContext, MemoryScope

    scope = MemoryScope(tenant="bench", user_pk=0)

    def record():
        with transaction.atomic():
            usage_event_record(scope, operation="remember", call=CallContext(channel="bench"))

    def insert_only():
        with transaction.atomic():
            UsageEvent.objects.create(user_id="0", operation="remember", channel="bench")

    def empty_transaction():
        with transaction.atomic():
            pass

    for fn in (record, insert_only):  # warm up connections, broker tables, the pool
        for _ in range(20):
            fn()
    results = {
        "record_event": percentiles([timed(record) for _ in range(calls)]),
        "insert_only": percentiles([timed(insert_only) for _ in range(calls)]),
        "empty_transaction": percentiles([timed(empty_transaction) for _ in range(calls)]),
    }
    UsageEvent.objects.filter(channel="bench").delete()
    for name, figures in results.items():
        print(f"{name:<18} {figures}")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    with bench_database():
        results = run(args.calls)
    write_results("billing", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
