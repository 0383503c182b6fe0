"""Review 19, runtime: the launcher fails fast and says why (bad PORT, worker concurrency, a
port in use, an unreachable or malformed DATABASE_URL, a child that never started), logs
"up" only once /healthz answers, lets a long call finish on SIGTERM, and does not claim to
stop a Postgres it never started; a malformed PROXY_ENCRYPTION_KEY stops the start (system
check); /healthz reports the search plan the engine really uses."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from cryptography.fernet import Fernet
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import Client

from memsite import launcher
from memsite.checks import proxy_encryption_key_check
from memsite.dbinfo import DatabaseInfo, vector_search_plan
from memsite.embedded_pg import EmbeddedPostgres
from memsite.env import ConfigError, env_int, env_map
from tests.conftest import free_port, wait_for
from tests.environment import ROOT

SECRET = "sekret-pw-0b7c"


def _launcher_env(data_dir: Path, **overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DATABASE_NAME", "CELERY_BROKER_URL")}
    env.update(MEMSITE_DATA_DIR=str(data_dir), PORT=str(free_port()), MEMSITE_ENV="local")
    env.update(overrides)
    return env


def _launch(data_dir: Path, **overrides: str) -> tuple[int, str, float]:
    """Run the launcher to its end (it must end by itself): exit code, output, seconds."""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "memsite.launcher"],
        cwd=ROOT,
        env=_launcher_env(data_dir, **overrides),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result.returncode, result.stdout + result.stderr, time.monotonic() - started


@pytest.fixture
def data_dir():
    # Unix socket paths must stay short, so not under pytest's deep tmp_path.
    with tempfile.TemporaryDirectory(prefix="msr-") as tmp:
        yield Path(tmp) / "data"


# --- 3: configuration the launcher needs is checked before anything starts ------------------


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"PORT": "70000"}, "PORT must be"),
        ({"CELERY_WORKER_CONCURRENCY": "abc"}, "CELERY_WORKER_CONCURRENCY must be an integer"),
        ({"CELERY_WORKER_CONCURRENCY": "0"}, "CELERY_WORKER_CONCURRENCY must be >= 1"),
    ],
)
def test_bad_launcher_settings_stop_the_start_at_once(data_dir, overrides, says):
    code, output, _ = _launch(data_dir, **overrides)
    assert code == 1, output
    assert "memsite failed to start: " + says in output
    assert "memsite is up" not in output and "restarting" not in output and "started web" not in output
    assert not (data_dir / "postgres").exists()  # nothing was started


def test_a_port_in_use_stops_the_start_before_postgres(data_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, output, _ = _launch(data_dir, PORT=str(port))
    assert code == 1, output
    assert f"memsite failed to start: cannot listen on 127.0.0.1:{port}" in output
    assert "memsite is up" not in output and "restarting" not in output
    assert not (data_dir / "postgres").exists()


def test_env_int_maximum_and_env_map(monkeypatch):
    monkeypatch.setenv("SOME_PORT", "70000")
    with pytest.raises(ConfigError, match="SOME_PORT must be <= 65535, got 70000"):
        env_int("SOME_PORT", 8000, minimum=1, maximum=65535)
    monkeypatch.setenv("SOME_PORT", "65535")
    assert env_int("SOME_PORT", 8000, minimum=1, maximum=65535) == 65535

    monkeypatch.setenv("SOME_MAP", "acme-corp:acme, globex : globex")
    assert env_map("SOME_MAP") == {"acme-corp": "acme", "globex": "globex"}
    for bad in ("bad", "acme-corp:acme,bad", ":acme", "acme:"):
        monkeypatch.setenv("SOME_MAP", bad)
        with pytest.raises(ConfigError, match="SOME_MAP must look like key:value"):
            env_map("SOME_MAP")
    monkeypatch.delenv("SOME_MAP")
    assert env_map("SOME_MAP") == {}


# --- 3: a child that never started stops the launcher; "up" waits for /healthz ---------------


def _in_process_launcher(children: list[launcher.Child]) -> launcher.Launcher:
    instance = launcher.Launcher()
    instance.children = children
    for child in children:
        child.start()
    return instance


def _stop_after(instance: launcher.Launcher, seconds: float) -> threading.Timer:
    """Without the fix `_supervise` never returns by itself: end it after `seconds`."""
    timer = threading.Timer(seconds, lambda: setattr(instance, "stopping", True))
    timer.start()
    return timer


def test_a_child_failing_before_it_started_stops_the_launcher(caplog):
    failing = launcher.Child("web", [sys.executable, "-c", "import sys; sys.exit(3)"])
    instance = _in_process_launcher([failing])
    timer = _stop_after(instance, 8)
    started = time.monotonic()
    try:
        with caplog.at_level(logging.INFO, logger="memsite.launcher"):
            code = instance._supervise()
    finally:
        timer.cancel()
        instance._stop_children()
    assert code == 1
    assert time.monotonic() - started < 5
    assert "web failed to start (exit 3; see above)" in caplog.text
    assert "restarting" not in caplog.text


def test_a_child_that_had_started_is_restarted(caplog):
    crashing = launcher.Child("worker", [sys.executable, "-c", "import sys; sys.exit(3)"])
    crashing.has_started = True
    instance = _in_process_launcher([crashing])
    timer = _stop_after(instance, 2)
    try:
        with caplog.at_level(logging.INFO, logger="memsite.launcher"):
            code = instance._supervise()
    finally:
        timer.cancel()
        instance._stop_children()
    assert code == 0
    assert "worker exited with 3; restarting" in caplog.text
    assert "failed to start" not in caplog.text


SLOW_WEB = """
import http.server, sys, time
time.sleep(float(sys.argv[2]))
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_up_is_logged_once_healthz_answers(settings, caplog):
    settings.HOST, settings.PORT = "127.0.0.1", free_port()
    web = launcher.Child("web", [sys.executable, "-c", SLOW_WEB, str(settings.PORT), "2"])
    instance = _in_process_launcher([web])
    lines: list[tuple[float, str]] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append((time.monotonic(), record.getMessage()))

    handler = Collect()
    logging.getLogger("memsite.launcher").addHandler(handler)
    started = time.monotonic()
    supervising = threading.Thread(target=instance._supervise)
    try:
        with caplog.at_level(logging.INFO, logger="memsite.launcher"):
            supervising.start()
            wait_for(lambda: any("memsite is up" in m for _, m in lines), timeout=30, what="the up line")
    finally:
        instance.stopping = True
        supervising.join(10)
        instance._stop_children()
        logging.getLogger("memsite.launcher").removeHandler(handler)
    (up_at,) = [at for at, message in lines if "memsite is up" in message]
    assert up_at - started >= 2  # not before the web process serves
    assert web.has_started


# --- 4: DATABASE_URL problems are one line, without the password ------------------------------


def test_an_unreachable_database_url_is_one_line_without_the_password(data_dir):
    port = free_port()
    code, output, _ = _launch(data_dir, DATABASE_URL=f"postgresql://memsite:{SECRET}@127.0.0.1:{port}/memsite")
    assert code == 1, output
    assert f"memsite failed to start: cannot reach the database from DATABASE_URL (127.0.0.1:{port}): " in output
    assert "Connection refused" in output
    assert SECRET not in output and "Traceback" not in output and "Applying" not in output


def test_a_malformed_database_url_is_one_line_without_the_url(data_dir):
    code, output, _ = _launch(data_dir, DATABASE_URL=f"postgresql://memsite:{SECRET}@db:notaport/memsite")
    assert code == 1, output
    assert "memsite failed to start: " in output
    assert SECRET not in output and "Traceback" not in output


# --- 7: a launcher that never started Postgres does not say it stopped it --------------------


def test_a_second_launcher_does_not_claim_to_stop_postgres(data_dir):
    owner = EmbeddedPostgres(data_dir)
    assert owner.try_lock()
    try:
        code, output, _ = _launch(data_dir)
    finally:
        owner.release_lock()
    assert code != 0
    assert "another memsite process owns" in output
    assert "embedded postgres stopped" not in output


# --- 2: a malformed PROXY_ENCRYPTION_KEY stops the start ---------------------------------------


def test_a_malformed_proxy_encryption_key_fails_the_checks(settings):
    settings.PROXY_ENCRYPTION_KEY = SECRET
    (error,) = proxy_encryption_key_check()
    assert error.id == "memsite.E001" and "PROXY_ENCRYPTION_KEY is not a Fernet key" in error.msg
    assert SECRET not in error.msg + (error.hint or "")
    with pytest.raises(SystemCheckError, match="memsite.E001"):
        call_command("check")
    settings.PROXY_ENCRYPTION_KEY = Fernet.generate_key().decode()
    assert proxy_encryption_key_check() == []
    settings.PROXY_ENCRYPTION_KEY = ""  # derived from SECRET_KEY
    assert proxy_encryption_key_check() == []


def test_the_launcher_refuses_a_malformed_proxy_encryption_key(data_dir):
    """The launcher migrates before serving, and migrate runs the system checks first (or,
    should settings.py check the key itself, the settings do not load)."""
    code, output, _ = _launch(data_dir, PROXY_ENCRYPTION_KEY=SECRET)
    assert code == 1, output
    assert "memsite failed to start: " in output
    assert (
        "(memsite.E001) PROXY_ENCRYPTION_KEY is not a Fernet key" in output
        and "manage.py migrate failed with exit 1 (see above)" in output
    ) or "memsite failed to start: PROXY_ENCRYPTION_KEY" in output
    assert SECRET not in output and "Traceback" not in output
    assert "started web" not in output and "Applying" not in output


# --- 5: /healthz reports the engine's real search plan ----------------------------------------


def test_vector_search_plan_follows_the_engine_rule(settings):
    new = DatabaseInfo(server_version="18.6", server_version_num=180006, pgvector_version="0.8.6")
    old = DatabaseInfo(server_version="16.2", server_version_num=160002, pgvector_version="0.6.2")
    settings.MEMORY_HNSW = True  # mem0's own index: not what the engine's searches use
    settings.SEARCH_INDEX_MIN_ROWS = 5000
    assert vector_search_plan(new) == "adaptive"
    assert vector_search_plan(old) == "exact"
    settings.SEARCH_INDEX_MIN_ROWS = 0
    assert vector_search_plan(new) == "exact"
    assert vector_search_plan(None) is None


def test_healthz_has_no_search_plan_while_the_database_is_unreachable(monkeypatch):
    # The outage itself is tests/test_backend_unavailable.py's; here only what /healthz says.
    monkeypatch.setattr("memsite.views._check_database", lambda: (None, "OperationalError"))
    response = Client().get("/healthz")
    assert response.status_code == 503
    body = json.loads(response.content)
    assert body["vector_search_plan"] is None and body["postgres"] is None


# --- 6: SIGTERM lets a call of up to ~17 s finish ----------------------------------------------

SLOW_APP = """
import asyncio

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    await asyncio.sleep(12)  # longer than uvicorn's former 10 s grace
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"finished"})
"""


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_sigterm_lets_a_long_call_finish(settings, tmp_path):
    assert 10 < launcher.WEB_GRACEFUL_SHUTDOWN_S < launcher.STOP_TIMEOUT_S
    (tmp_path / "slow_app.py").write_text(SLOW_APP)
    settings.HOST, settings.PORT = "127.0.0.1", free_port()
    (web,) = [child for child in launcher._children(settings) if child.name == "web"]
    web.argv[web.argv.index("memsite.asgi:application")] = "slow_app:app"
    web.argv += ["--app-dir", str(tmp_path)]
    instance = _in_process_launcher([web])
    wait_for(lambda: _accepts(settings.PORT), timeout=30, what="uvicorn to listen")

    result: dict = {}

    def call() -> None:
        url = f"http://127.0.0.1:{settings.PORT}/v1/slow"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310 - loopback only
                result["answer"] = (response.status, response.read())
        except urllib.error.HTTPError as exc:
            result["answer"] = (exc.code, exc.read())

    calling = threading.Thread(target=call)
    calling.start()
    time.sleep(1)  # the call is in flight
    instance._stop_children()  # SIGTERM, as on the launcher's own SIGTERM
    calling.join(30)
    assert result["answer"] == (200, b"finished")
    assert web.exited() in (0, -15)  # uvicorn re-raises SIGTERM once it has shut down
