"""The whole service as a user runs it: `python -m memsite.launcher` on embedded defaults.

Start, answer health and MCP, stop with SIGTERM, start again, die by SIGKILL, restart:
no process outlives its launcher, no stale lock blocks a restart, data survives, and no
process tries to reach the network (the session's netguard log stays empty)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.conftest import free_port, wait_for
from tests.environment import ROOT

pytestmark = pytest.mark.slow


def _get(url: str, data: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - loopback only
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


class Service:
    def __init__(self, data_dir: Path, port: int):
        self.data_dir = data_dir
        self.port = port
        self.process: subprocess.Popen | None = None
        self.log_path = data_dir.parent / "launcher.log"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DATABASE_NAME", "CELERY_BROKER_URL")}
        env.update(MEMSITE_DATA_DIR=str(self.data_dir), PORT=str(self.port), MEMSITE_ENV="local")
        return env

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "memsite.launcher"], cwd=ROOT, env=self.env(), stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        wait_for(self.healthy, timeout=120, interval=0.5, what=lambda: f"health; log:\n{self.log()}")

    def healthy(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"launcher exited with {self.process.returncode}:\n{self.log()}")
        status, body = _get(f"http://127.0.0.1:{self.port}/healthz")
        return status == 200 and json.loads(body)["status"] == "ok"

    def manage(self, *args: str) -> str:
        result = subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=self.env(), capture_output=True, text=True, check=True
        )
        return result.stdout

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)

    def command_lines(self) -> dict[int, str]:
        """pid -> command line of each descendant still running. Postgres backends come and
        go while the list is read; one that exits in between is skipped, not an error."""
        lines = {}
        for process in self.descendants():
            try:
                lines[process.pid] = " ".join(process.cmdline())
            except psutil.NoSuchProcess:  # ZombieProcess is one too
                continue
        return lines

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _service_processes(data_dir: Path, pids: list[int]) -> list[psutil.Process]:
    """Processes still alive from an earlier set, or any postgres on this data dir."""
    alive = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    for proc in psutil.process_iter(["cmdline"]):
        if str(data_dir / "postgres") in " ".join(proc.info["cmdline"] or []) and proc not in alive:
            alive.append(proc)
    return alive


@pytest.fixture
def service():
    # Unix socket paths must stay short, so not under pytest's deep tmp_path.
    with tempfile.TemporaryDirectory(prefix="msl-") as tmp:
        svc = Service(Path(tmp) / "data", free_port())
        try:
            yield svc
        finally:
            if svc.process and svc.process.poll() is None:
                svc.process.send_signal(signal.SIGTERM)
                svc.process.wait(60)


def _mcp_initialize(port: int, token: str | None = None) -> tuple[int, dict]:
    payload = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "launcher-test", "version": "1"},
        },
    }
    status, body = _get(
        f"http://127.0.0.1:{port}/engines/memory/mcp",
        data=json.dumps(payload).encode(),
        headers={
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            **({"Authorization": f"Bearer {token}"} if token else {}),
        },
    )
    return status, json.loads(body) if body else {}


def test_start_stop_kill_restart(service):
    service.start()
    children = service.descendants()
    names = " ".join(service.command_lines().values())
    assert "uvicorn" in names and "worker" in names and "beat" in names and "postgres" in names

    status, body = _mcp_initialize(service.port)
    assert status == 401 and body["error"]["code"] == "unauthenticated"
    key = service.manage("issue_api_key", "carol", "--create-user").strip().splitlines()[-1]
    assert key.startswith("msk_")
    status, body = _mcp_initialize(service.port, key)
    assert status == 200, body
    assert body["result"]["serverInfo"]["name"] == "memsite-memory"

    # Metrics: the web process writes its samples under the data dir; /metrics sums them.
    status, body = _get(f"http://127.0.0.1:{service.port}/metrics")
    assert status == 200
    assert b'memsite_unauthenticated_requests_total{channel="mcp"} 1.0' in body
    assert list((service.data_dir / "metrics").glob("counter_*.db"))

    # A second launcher on the same data dir is refused while the first runs.
    second = subprocess.run(
        [sys.executable, "-m", "memsite.launcher"],
        cwd=ROOT,
        env=service.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode != 0 and "owns" in second.stderr

    # SIGTERM: everything stops, cleanly.
    pids = [service.process.pid] + [p.pid for p in children]
    service.process.send_signal(signal.SIGTERM)
    assert service.process.wait(60) == 0
    wait_for(lambda: not _service_processes(service.data_dir, pids), timeout=30, what="children to exit")
    assert not (service.data_dir / "postgres" / "postmaster.pid").exists()

    # Restart, then SIGKILL the launcher: its children follow it (parent-death signal).
    service.start()
    pids = [service.process.pid] + [p.pid for p in service.descendants()]
    service.process.kill()
    service.process.wait(10)
    wait_for(
        lambda: not _service_processes(service.data_dir, pids),
        timeout=60,
        what=lambda: f"orphans to exit: {_service_processes(service.data_dir, pids)}",
    )

    # Restart after the crash: no stale lock, data intact, the key still there.
    service.start()
    # A new run counts from zero (the launcher empties the metrics directory).
    assert b"memsite_unauthenticated_requests_total{" not in _get(f"http://127.0.0.1:{service.port}/metrics")[1]
    count = service.manage("shell", "-c", "from memories.models import ApiKey; print(ApiKey.objects.count())")
    assert count.strip().splitlines()[-1] == "1"

    # SIGHUP (the terminal it ran in was closed): a clean stop as well, not a death.
    pids = [service.process.pid] + [p.pid for p in service.descendants()]
    service.process.send_signal(signal.SIGHUP)
    assert service.process.wait(60) == 0
    wait_for(lambda: not _service_processes(service.data_dir, pids), timeout=30, what="children to exit")
    assert not (service.data_dir / "postgres" / "postmaster.pid").exists()
