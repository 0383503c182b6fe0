from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.db import connection

from memories.scope import MemoryScope
from tests.environment import ROOT, TEST_DATABASE


@pytest.fixture(scope="session", autouse=True)
def _engine_closed_before_test_db_teardown(django_db_setup):  # noqa: PT004
    yield
    from kombu.transport.sqlalchemy import Channel

    from memories.engine import engine_close
    from memsite.celery import app

    engine_close()
    app.pool.force_close_all()
    for sqla_engine, _ in list(Channel._engines.values()):
        sqla_engine.dispose()
    Channel._engines.clear()


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user("alice", "alice@example.com", "alice-password-1")


@pytest.fixture
def bob(django_user_model):
    return django_user_model.objects.create_user("bob", "bob@example.com", "bob-password-1")


@pytest.fixture
def charlie(django_user_model):
    return django_user_model.objects.create_user("charlie", "charlie@example.com", "charlie-password-1")


@pytest.fixture
def alice_scope(alice) -> MemoryScope:
    return MemoryScope.for_user(alice)


@pytest.fixture
def bob_scope(bob) -> MemoryScope:
    return MemoryScope.for_user(bob)


@pytest.fixture
def clean_vectors():
    """Engine rows are written through mem0's own pool, outside test transactions."""
    yield
    from django.conf import settings

    with connection.cursor() as cursor:
        for table in (settings.MEMORY_COLLECTION, f"{settings.MEMORY_COLLECTION}_entities"):
            cursor.execute(f'DELETE FROM "{table}"')  # noqa: S608 - our own table names


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate, *, timeout: float, interval: float = 0.2, what="condition"):
    """Poll `predicate` until truthy. `what` may be a callable, evaluated on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what() if callable(what) else what}")
        time.sleep(interval)


def service_env(**overrides: str) -> dict[str, str]:
    """Environment for a Python subprocess of ours, sharing the test database."""
    env = dict(os.environ)
    env["DATABASE_NAME"] = TEST_DATABASE
    env.update(overrides)
    return env


class WorkerProcess:
    def __init__(self, log_path: Path, env: dict[str, str]):
        self.log_path = log_path
        self.env = env
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "celery", "-A", "memsite", "worker", "--loglevel", "INFO",
                "--concurrency", "1", "--without-gossip", "--without-mingle", "--without-heartbeat",
                "--hostname", f"test-{os.getpid()}@%h",
            ],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@pytest.fixture
def celery_worker_process(transactional_db, tmp_path):  # noqa: ARG001 - needs the test DB
    worker = WorkerProcess(tmp_path / "worker.log", service_env())
    worker.start()
    yield worker
    worker.stop()
