"""Scale-out: two web processes and a Celery worker on one Postgres, with Redis as the
broker (Debian's redis-server on 127.0.0.1). Load goes through both web processes; the
rate limit holds exactly across them and every usage event reaches the (fake) payment
gateway exactly once."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from billing.models import UsageEvent
from tests.conftest import ROOT, WorkerProcess, billing_env, free_port, service_env, wait_for

pytestmark = pytest.mark.slow

LIMIT = 12  # list_memory calls allowed per user and day (an exact sliding window) in this test


def _redis_server() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    if os.environ.get("CI"):  # .ci/run installs it: its absence there is a failure, not a skip
        pytest.fail("redis-server is not installed (CI installs Debian's redis-server in .ci/run)")
    pytest.skip("redis-server is not installed: `apt-get install redis-server` to run the scale-out test")


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class Process:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir) -> None:
        self.log_path = log_dir / f"{name}.log"
        log = open(self.log_path, "ab")  # noqa: SIM115
        self.process = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_listening(self, port: int, timeout: float = 90) -> None:
        def up() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"{self.log_path.name} exited:\n{self.log()[-3000:]}")
            return _port_open(port)

        wait_for(up, timeout=timeout, what=lambda: self.log()[-3000:])

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def _get(url: str, token: str) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


@pytest.fixture
def redis_broker(tmp_path):
    server = _redis_server()
    port = free_port()
    process = Process(
        "redis",
        [server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path), "--daemonize", "no"],
        dict(os.environ),
        tmp_path,
    )  # fmt: skip
    process.wait_listening(port, timeout=30)
    yield f"redis://127.0.0.1:{port}/0"
    process.stop()


def test_two_web_processes_and_a_worker_on_a_redis_broker(
    transactional_db, tmp_path, redis_broker, alice, alice_key, fake_llm, fake_gateway
):
    env = service_env(
        CELERY_BROKER_URL=redis_broker,
        RATE_LIMIT_LIST_MEMORY=f"{LIMIT}/day",
        LLM_BASE_URL=f"{fake_llm.url}/v1",
        LLM_MODEL="fake-model",
        LLM_API_KEY="fake-key",
        **billing_env(fake_gateway),
    )
    ports = [free_port(), free_port()]
    webs = [
        Process(
            f"web-{port}",
            [sys.executable, "-m", "uvicorn", "memsite.asgi:application", "--host", "127.0.0.1", "--port", str(port)],
            env,
            tmp_path,
        )
        for port in ports
    ]
    worker = WorkerProcess(tmp_path / "worker.log", env)
    worker.start()
    try:
        for web, port in zip(webs, ports, strict=True):
            web.wait_listening(port)
        wait_for(lambda: "ready" in worker.log(), timeout=90, what=lambda: worker.log()[-3000:])
        # Celery masks the (empty) password: "Connected to redis://:**@127.0.0.1:PORT/0".
        assert "Connected to redis://" in worker.log() and redis_broker.removeprefix("redis://") in worker.log()

        urls = [f"http://127.0.0.1:{port}/v1/memories" for port in ports]
        # One call through each process first (both count against the same window) ...
        assert [_get(url, alice_key) for url in urls] == [200, 200]
        # ... then a concurrent burst of twice the limit, alternating between them.
        burst = [urls[i % 2] for i in range(2 * LIMIT)]
        with ThreadPoolExecutor(max_workers=8) as pool:
            statuses = list(pool.map(lambda url: _get(url, alice_key), burst))
        assert set(statuses) <= {200, 429}, statuses
        assert statuses.count(200) == LIMIT - 2, statuses  # exactly LIMIT allowed in all
        assert _get(urls[0], alice_key) == 429 and _get(urls[1], alice_key) == 429

        # One usage event per allowed call, none for refused ones, each delivered once by the
        # worker, which got its tasks through Redis from both web processes.
        events = [str(r) for r in UsageEvent.objects.values_list("request_id", flat=True)]
        assert len(events) == LIMIT == len(set(events))

        def delivered() -> bool:
            pending = UsageEvent.objects.exclude(status=UsageEvent.Status.DELIVERED).exists()
            return not pending and set(fake_gateway.received_ids()) == set(events)

        wait_for(delivered, timeout=90, what=lambda: worker.log()[-3000:])
        time.sleep(2)  # a duplicate delivery would arrive now
        received = fake_gateway.received_ids()
        assert sorted(received) == sorted(events), "every event exactly once"
        assert "Task billing.deliver_usage_events" in worker.log()
    finally:
        for web in webs:
            web.stop()
        worker.stop()
