"""`python -m memsite.launcher`: run the whole service from one process.

Owns the embedded Postgres (unless DATABASE_URL is set) and supervises the web server
(uvicorn: Django + MCP), a Celery worker and Celery beat. Every child gets a
parent-death signal, so even `kill -9` of the launcher leaves no process behind; an
flock on the data dir (released by the kernel on any exit) keeps two launchers apart
and leaves no stale lock. SIGINT/SIGTERM stop the children, then Postgres.

Self-healing: when the embedded Postgres dies it is restarted with backoff while the
children keep running (the web process answers 503 backend_unavailable meanwhile, and
every connection pool reconnects afterwards); a child that exits is restarted with
backoff too. Nothing gives up while the launcher runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("memsite.launcher")

ROOT = Path(__file__).resolve().parent.parent
STOP_TIMEOUT_S = 20.0
# Restarts within this window count towards the backoff; a process up longer starts afresh.
RESTART_WINDOW_S = 60.0
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


def backoff_delay(attempt: int) -> float:
    """Seconds to wait before restart number `attempt` (1-based) within the window."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(0, attempt - 1))


def _settings():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "memsite.settings")
    from django.conf import settings

    return settings


def _child_preexec() -> None:
    from memsite.embedded_pg import set_parent_death_signal

    set_parent_death_signal(signal.SIGTERM)


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path | None = None
    process: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)

    def start(self) -> None:
        out = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        self.process = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            preexec_fn=_child_preexec,
            start_new_session=True,  # the launcher decides when children see signals
        )
        if out:
            out.close()
        logger.info("started %s (pid %s)", self.name, self.process.pid)

    def exited(self) -> int | None:
        return self.process.poll() if self.process else None

    def restart_delay(self) -> float:
        """Record a restart and say how long to wait before it (exponential backoff)."""
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
        return backoff_delay(len(self.restarts))


def _children(settings) -> list[Child]:
    python = sys.executable
    log_dir = settings.DATA_DIR / "logs" if os.environ.get("MEMSITE_LOG_TO_FILES") == "1" else None
    concurrency = os.environ.get("CELERY_WORKER_CONCURRENCY", "2")

    def log(name: str) -> Path | None:
        return log_dir / f"{name}.log" if log_dir else None

    return [
        Child(
            "web",
            [
                python, "-m", "uvicorn", "memsite.asgi:application",
                "--host", settings.HOST, "--port", str(settings.PORT),
                "--lifespan", "on", "--timeout-graceful-shutdown", "10", "--no-server-header",
            ],
            log("web"),
        ),
        Child(
            "worker",
            [
                python, "-m", "celery", "-A", "memsite", "worker", "--loglevel", "INFO",
                "--concurrency", concurrency, "--without-gossip", "--without-mingle",
                "--hostname", f"worker-{os.getpid()}@%h",
            ],
            log("worker"),
        ),
        Child(
            "beat",
            [
                python, "-m", "celery", "-A", "memsite", "beat", "--loglevel", "INFO",
                "--scheduler", "django_celery_beat.schedulers:DatabaseScheduler", "--pidfile=",
            ],
            log("beat"),
        ),
    ]  # fmt: skip


def _metrics_dir_prepare(settings) -> None:
    """Web, worker and beat write their metric samples under one directory that
    /metrics sums (prometheus-client multi-process mode); a new run starts from zero."""
    from memsite.observability import MULTIPROC_ENV, multiproc_dir_prepare

    path = Path(os.environ.get(MULTIPROC_ENV) or settings.DATA_DIR / "metrics")
    os.environ[MULTIPROC_ENV] = str(multiproc_dir_prepare(path))
    logger.info("metrics samples under %s", path)


def _metrics_process_dead(child: Child) -> None:
    from memsite.observability import multiproc_process_dead

    if child.process is not None:
        multiproc_process_dead(child.process.pid)


def _archive_settings(data_dir: Path) -> dict[str, str]:
    from memsite.backup import server_settings

    return server_settings(data_dir)


def _first_backup(settings) -> Child | None:
    """A base backup right after start when none is recent (beat checks again every 15 min):
    WAL archiving alone cannot restore anything without one."""
    if not (settings.EMBEDDED_DATABASE and settings.BACKUP_ENABLED):
        return None
    log_dir = settings.DATA_DIR / "logs" if os.environ.get("MEMSITE_LOG_TO_FILES") == "1" else None
    child = Child(
        "backup", [sys.executable, "manage.py", "backup", "--if-due"], log_dir / "backup.log" if log_dir else None
    )
    child.start()

    def reap() -> None:  # at once, so no zombie lingers in the process tree
        assert child.process is not None
        code = child.process.wait()
        if code != 0:
            logger.error("the first base backup failed (exit %s); beat retries every 15 min", code)

    threading.Thread(target=reap, name="backup-reaper", daemon=True).start()
    return child


def _migrate() -> None:
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, check=True)


def _erasures_reapply(settings) -> None:
    """A restored data dir (`manage.py restore` left its marker): re-apply the erasures after
    its recovery point before anything serves it. Here rather than in `restore`: after the
    migrations (the erasure service needs the current schema, a restore may predate one),
    for in-place restores and copies alike, and again at every start until it succeeded
    (a failure stops the start: serving erased data is worse than not serving)."""
    from memsite.backup import REAPPLY_MARKER

    if not (settings.DATA_DIR / REAPPLY_MARKER).exists():
        return
    logger.info("restored data dir: re-applying the erasures after its recovery point")
    subprocess.run([sys.executable, "manage.py", "erasures", "--reapply"], cwd=ROOT, check=True)


class Launcher:
    def __init__(self) -> None:
        self.settings = _settings()
        self.postgres: Any = None
        self.children: list[Child] = []
        self.backup: Child | None = None  # one-shot, not restarted
        self.stopping = False

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        if not self.stopping:
            logger.info("received %s, stopping", signal.Signals(signum).name)
        self.stopping = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self._start_database()
            if self.stopping:
                return 0
            _migrate()
            _erasures_reapply(self.settings)
            _metrics_dir_prepare(self.settings)
            self.children = _children(self.settings)
            for child in self.children:
                child.start()
            self.backup = _first_backup(self.settings)
            logger.info("memsite is up on http://%s:%s/", self.settings.HOST, self.settings.PORT)
            return self._supervise()
        finally:
            self._stop_children()
            self._stop_database()

    def _start_database(self) -> None:
        if not self.settings.EMBEDDED_DATABASE:
            return
        from memsite.embedded_pg import EmbeddedPostgres

        self.postgres = EmbeddedPostgres(self.settings.DATA_DIR)
        if not self.postgres.try_lock():
            raise SystemExit(f"another memsite process owns {self.settings.DATA_DIR} (launcher or manage.py)")
        self.postgres.server_settings = _archive_settings(self.settings.DATA_DIR)
        self.postgres.start()
        logger.info("embedded postgres ready (socket dir %s)", self.postgres.paths.socket_dir)

    def _supervise(self) -> int:
        due: dict[str, float] = {}  # child name -> when its pending restart may happen
        while not self.stopping:
            time.sleep(0.25)
            if self.postgres and (self.postgres.process is None or self.postgres.process.poll() is not None):
                self._restart_database()
            now = time.monotonic()
            for child in self.children:
                if self.stopping:
                    break
                code = child.exited()
                if code is None:
                    continue
                if child.name not in due:
                    _metrics_process_dead(child)
                    delay = child.restart_delay()
                    logger.warning("%s exited with %s; restarting in %.1fs", child.name, code, delay)
                    due[child.name] = now + delay
                if now >= due[child.name]:
                    del due[child.name]
                    child.start()
        return 0

    def _restart_database(self) -> None:
        """Bring the embedded Postgres back; the children keep running and reconnect."""
        logger.error(
            "embedded postgres exited (%s); restarting it, the service answers 503 meanwhile",
            self.postgres.process.returncode if self.postgres.process else "not running",
        )
        started = time.monotonic()
        attempt = 0
        while not self.stopping:
            attempt += 1
            try:
                # The old postmaster's backends exit on their own within a moment; until they
                # have, the new one refuses the still-attached shared memory and we retry.
                self.postgres.restart(timeout=30)
            except (RuntimeError, OSError) as exc:
                delay = backoff_delay(attempt)
                logger.warning("embedded postgres restart %s failed (%s); retrying in %.1fs", attempt, exc, delay)
                self._sleep(delay)
                continue
            logger.info("embedded postgres is back after %.1fs", time.monotonic() - started)
            return

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(0.1, seconds))

    def _stop_children(self) -> None:
        children = self.children + ([self.backup] if self.backup else [])
        running = [(c.name, c.process) for c in children if c.process and c.process.poll() is None]
        for _, process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for name, process in running:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %ss; killing", name, STOP_TIMEOUT_S)
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            # Celery's prefork pool children are in the same session: make sure of them.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)

    def _stop_database(self) -> None:
        if self.postgres:
            self.postgres.stop()
            self.postgres.release_lock()
            logger.info("embedded postgres stopped")


@contextlib.contextmanager
def embedded_database_for_command() -> Iterator[None]:
    """For manage.py: make sure the embedded Postgres answers while the command runs.

    If the service (or another command) already runs it, use that; otherwise start it
    for this command's duration, holding the data-dir lock."""
    settings = _settings()
    if not settings.EMBEDDED_DATABASE:
        yield
        return
    from memsite.embedded_pg import EmbeddedPostgres, is_answering

    if is_answering(settings.DATA_DIR):
        yield
        return
    postgres = EmbeddedPostgres(settings.DATA_DIR)
    if not postgres.try_lock():
        _wait_until_answering(settings.DATA_DIR)
        yield
        return
    try:
        # Archiving on for every start of this data dir, or its WAL would have a gap.
        postgres.server_settings = _archive_settings(settings.DATA_DIR)
        postgres.start()
        yield
    finally:
        postgres.stop()
        postgres.release_lock()


def _wait_until_answering(data_dir: Path, timeout: float = 60.0) -> None:
    from memsite.embedded_pg import is_answering

    deadline = time.monotonic() + timeout
    while not is_answering(data_dir):
        if time.monotonic() > deadline:
            raise SystemExit(f"the embedded database under {data_dir} is locked but not answering")
        time.sleep(0.2)


def _configure_logging() -> None:
    """The children's format (LOG_FORMAT), so one stream reads (or parses) alike."""
    import logging.config

    try:
        logging.config.dictConfig(_settings().LOGGING)
    except Exception:  # settings do not load: Launcher() reports why, in the plain format
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s launcher: %(message)s")


def main() -> int:
    _configure_logging()
    try:
        return Launcher().run()
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        logger.error("memsite failed to start: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
