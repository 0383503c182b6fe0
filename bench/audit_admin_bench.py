"""The support console on a big audit table: admin changelist pages with 1M audit rows.

bench/run audit_admin [--rows 1000000] [--repeat 10]
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.common import bench_database, percentiles, timed, write_results

FILL = """
INSERT INTO audit_auditevent (occurred_at, request_id, channel, operation, outcome, error_code, actor_user_id,
    actor_username, actor_auth, actor_client_app, actor_role, staff_username, tenant, subject_user_id, memory_ids,
    detail, user_agent, turn_id, turn_event)
SELECT now() - (i || ' seconds')::interval, md5(i::text), 'mcp',
    (ARRAY['remember', 'search_memory', 'list_memory', 'update_memory'])[1 + i %% 4],
    CASE WHEN i %% 20 = 0 THEN 'error' ELSE 'ok' END, CASE WHEN i %% 20 = 0 THEN 'not_found' ELSE '' END,
    1 + i %% 1000, 'user' || (1 + i %% 1000), 'api_key', 'bench-agent', 'user', '', 'default', 1 + i %% 1000,
    jsonb_build_array(md5(i::text)::uuid::text), '{}'::jsonb, 'bench', '', ''
FROM generate_series(%s, %s) AS i
"""


def fill(rows: int) -> str:
    from django.db import connection

    from audit.models import AuditEvent

    have = AuditEvent.objects.count()
    with connection.cursor() as cursor:
        if have < rows:
            print(f"  inserting {rows - have} audit rows", file=sys.stderr)
            cursor.execute(FILL, [have + 1, rows])
            cursor.execute("ANALYZE audit_auditevent")
        cursor.execute("SELECT md5(%s::text)::uuid::text", [rows // 2])
        return cursor.fetchone()[0]


def run(rows: int, repeat: int) -> dict:
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.test import Client

    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
    memory_id = fill(rows)
    admin, _ = get_user_model().objects.get_or_create(
        username="bench-admin", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client()
    client.force_login(admin)
    pages = {
        "list (newest first)": "/admin/audit/auditevent/",
        "page 200": "/admin/audit/auditevent/?p=200",
        "one user's timeline": "/admin/audit/auditevent/?subject_user_id=7",
        "operation + outcome filter": "/admin/audit/auditevent/?operation=update_memory&outcome=error",
        "search a memory id": f"/admin/audit/auditevent/?q={memory_id}",
        "search a username": "/admin/audit/auditevent/?q=user7",
        "search a user id": "/admin/audit/auditevent/?q=7",
        "last 7 days": "/admin/audit/auditevent/?occurred_at__gte="
        + time.strftime("%Y-%m-%d", time.gmtime(time.time() - 7 * 86400)),
    }
    results = {}
    for name, url in pages.items():
        assert client.get(url).status_code == 200, url  # warm
        results[name] = percentiles([timed(lambda url=url: client.get(url)) for _ in range(repeat)])
        print(f"{name:<28} {results[name]}")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    with bench_database():
        results = run(args.rows, args.repeat)
    write_results("audit-admin", results, rows=args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
