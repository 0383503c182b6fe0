"""Django's PostgreSQL backend, with a pool checkout check that costs a syscall, not a round trip.

With CONN_HEALTH_CHECKS and a pool, Django hands psycopg_pool `ConnectionPool.check_connection`,
which sends an empty query on every checkout: ~0.2 ms, twice per MCP call (authentication, then
the tool), measured with bench/run mcp and py-spy. A connection the server has cut (restart,
failover, pg_terminate_backend) always leaves something readable on its socket: the server's
FATAL message, or end-of-file. An idle, healthy connection has nothing to read. So the check
polls the socket without waiting and does the full round trip only when there is something
to read, or when the connection is not plainly idle.
"""

from __future__ import annotations

import select
from typing import Any

import psycopg
from django.db.backends.postgresql import base as postgresql
from psycopg import pq
from psycopg_pool import ConnectionPool


def pooled_connection_check(conn: psycopg.Connection[Any]) -> None:
    """Raise if `conn` is unusable; psycopg_pool then discards it and hands out another."""
    if conn.closed or conn.broken:
        raise psycopg.OperationalError("the pooled connection is closed")
    if conn.pgconn.transaction_status == pq.TransactionStatus.IDLE:
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        if not poller.poll(0):
            return
    ConnectionPool.check_connection(conn)


class DatabaseWrapper(postgresql.DatabaseWrapper):
    @property
    def pool(self) -> ConnectionPool | None:
        pool = super().pool
        # psycopg_pool (pinned) keeps the check callback in `_check` and has no setter; the
        # pool is created by Django's property above, so swap it here, once per pool.
        if pool is not None and pool._check is ConnectionPool.check_connection:
            pool._check = pooled_connection_check
        return pool
