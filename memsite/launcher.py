"""`python -m memsite.launcher`: run the whole service from one process.

Owns the embedded Postgres (unless DATABASE_URL is set) and supervises the web server
(uvicorn: Django + MCP), a Celery worker and Celery beat. Every child gets a
parent-death signal, so even `kill -9` of the launcher leaves no process behind; an
flock on the data dir (released by the kernel on any exit) keeps two launchers apart
and leaves no stale lock. SIGINT/SIGTERM/SIGHUP stop the children, then Postgres.

Start-up fails fast, with one line saying why: a bad PORT or CELERY_WORKER_CONCURRENCY, a
port in use, an unreachable DATABASE_URL, a failed system check (migrate runs them), or a
child that exits with an error before it ever started (web: before /healthz answered).
"memsite is up" is logged once /healthz answers.

Self-healing: when the embedded Postgres dies it is restarted with backoff while the
children keep running (the web process answers 503 backend_unavailable meanwhile, and
every connection pool reconnects afterwards); a child that exits after it started is
restarted with backoff too. Nothing gives up while the launcher runs.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import signal
import socket
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
# uvicorn's grace for requests in flight after SIGTERM; a call still running then gets a 500.
# Below STOP_TIMEOUT_S, with room for its lifespan shutdown, so our SIGKILL never comes first.
WEB_GRACEFUL_SHUTDOWN_S = STOP_TIMEOUT_S - 3
# A worker or beat still running this long after its start has started (the web: once
# /healthz answers); one that exits with an error before that stops the launcher.
STARTED_AFTER_S = 10.0
HEALTHZ_TIMEOUT_S = 2.0
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
    started_at: float = 0.0
    # Once started, a child is restarted whenever it exits; before, an error exit is fatal.
    has_started: bool = False

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
        self.started_at = time.monotonic()
        logger.info("started %s (pid %s)", self.name, self.process.pid)

    def exited(self) -> int | None:
        return self.process.poll() if self.process else None

    def restart_delay(self) -> float:
        """Record a restart and say how long to wait before it (exponential backoff)."""
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
        return backoff_delay(len(self.restarts))


def _worker_concurrency() -> int:
    from memsite.env import env_int

    return env_int("CELERY_WORKER_CONCURRENCY", 2, minimum=1)


def _port_checked(settings) -> int:
    """settings.PORT, which must be a TCP port (settings accept any integer >= 1)."""
    from memsite.env import ConfigError

    if not 1 <= settings.PORT <= 65535:
        raise ConfigError(f"PORT must be between 1 and 65535, got {settings.PORT}")
    return settings.PORT


def _listen_check(host: str, port: int) -> None:
    """Fail before anything starts when uvicorn could not listen (port in use, host not
    local), rather than restarting a web process that exits at once. The same options as
    uvicorn's bind (SO_REUSEADDR), so a port in TIME_WAIT passes as it would for uvicorn."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _healthz_answers(host: str, port: int) -> bool:
    """Whether the web process answers HTTP on /healthz (any status: a 503 while the database
    is away, or a 400 from ALLOWED_HOSTS, still means it is serving)."""
    connect_to = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # noqa: S104
    conn = http.client.HTTPConnection(connect_to, port, timeout=HEALTHZ_TIMEOUT_S)
    try:
        conn.request("GET", "/healthz")
        conn.getresponse().read()
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()
    return True


def _children(settings) -> list[Child]:
    python = sys.executable
    log_dir = settings.DATA_DIR / "logs" if os.environ.get("MEMSITE_LOG_TO_FILES") == "1" else None
    concurrency = str(_worker_concurrency())

    def log(name: str) -> Path | None:
        return log_dir / f"{name}.log" if log_dir else None

    return [
        Child(
            "web",
            [
                python, "-m", "uvicorn", "memsite.asgi:application",
                "--host", settings.HOST, "--port", str(settings.PORT),
                "--lifespan", "on", "--timeout-graceful-shutdown", str(int(WEB_GRACEFUL_SHUTDOWN_S)),
                "--no-server-header",
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
    # migrate runs the system checks first (memsite/checks.py, ...) and prints what fails.
    result = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"manage.py migrate failed with exit {result.returncode} (see above)")


def _database_reachable(settings) -> None:
    """With DATABASE_URL: connect once before migrating, so an unreachable server is one
    line naming host and port (never the password), not a migrate traceback."""
    import psycopg

    db = settings.DATABASES["default"]
    host, port, password = db.get("HOST") or "", db.get("PORT") or "", db.get("PASSWORD") or ""
    # What Django's backend passes to psycopg too (sslmode and other URL query options).
    options = {
        k: v
        for k, v in (db.get("OPTIONS") or {}).items()
        if k not in ("pool", "isolation_level", "server_side_binding", "assume_role", "cursor_factory")
    }
    try:
        psycopg.connect(
            dbname=db.get("NAME") or None,
            user=db.get("USER") or None,
            password=password or None,
            host=host or None,
            port=str(port) if port else None,
            connect_timeout=10,
            **options,
        ).close()
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        if password:
            reason = reason.replace(password, "***")
        raise RuntimeError(
            f"cannot reach the database from DATABASE_URL ({host or 'local socket'}:{port or 5432}): {reason}"
        ) from None


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


def _settings_loaded():
    """The settings, loaded now: a ConfigError says what is wrong; any other failure is
    named by its type and line in settings.py, without its message (it may quote a value,
    e.g. a DATABASE_URL with its password)."""
    import traceback

    from memsite.env import ConfigError

    settings = _settings()
    try:
        settings.DATA_DIR  # noqa: B018 - forces the lazy settings to load
    except ConfigError:
        raise
    except Exception as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.endswith("settings.py")]
        where = f" at memsite/settings.py:{frames[-1].lineno}" if frames else ""
        raise ConfigError(
            f"the settings do not load ({type(exc).__name__}{where}); `python manage.py check` shows the traceback"
        ) from None
    return settings


class Launcher:
    def __init__(self) -> None:
        self.settings = _settings_loaded()
        self.postgres: Any = None
        self.postgres_started = False
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
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # ignored under nohup: keep running
            # The terminal it runs in closed: stop as cleanly as on SIGTERM.
            signal.signal(signal.SIGHUP, self._on_signal)
        try:
            port = _port_checked(self.settings)
            _worker_concurrency()
            self._lock_database()
            _listen_check(self.settings.HOST, port)
            self._start_database()
            if self.stopping:
                return 0
            if not self.settings.EMBEDDED_DATABASE:
                _database_reachable(self.settings)
            _migrate()
            _erasures_reapply(self.settings)
            _metrics_dir_prepare(self.settings)
            self.children = _children(self.settings)
            for child in self.children:
                child.start()
            self.backup = _first_backup(self.settings)
            return self._supervise()
        finally:
            self._stop_children()
            self._stop_database()

    def _lock_database(self) -> None:
        if not self.settings.EMBEDDED_DATABASE:
            return
        from memsite.embedded_pg import EmbeddedPostgres

        postgres = EmbeddedPostgres(self.settings.DATA_DIR)
        if not postgres.try_lock():
            raise SystemExit(f"another memsite process owns {self.settings.DATA_DIR} (launcher or manage.py)")
        self.postgres = postgres

    def _start_database(self) -> None:
        if self.postgres is None:
            return
        self.postgres.server_settings = _archive_settings(self.settings.DATA_DIR)
        self.postgres_started = True  # from here on a postmaster may run: stop it on the way out
        self.postgres.start()
        logger.info("embedded postgres ready (socket dir %s)", self.postgres.paths.socket_dir)

    def _mark_started(self, now: float) -> None:
        """The web has started once /healthz answers; the others once the web is up and they
        ran STARTED_AFTER_S (on a busy machine everything starts slowly, bad options included)."""
        web = next((c for c in self.children if c.name == "web"), None)
        if web is not None and not web.has_started:
            if web.exited() is not None or not _healthz_answers(self.settings.HOST, self.settings.PORT):
                return
            web.has_started = True
            logger.info("memsite is up on http://%s:%s/", self.settings.HOST, self.settings.PORT)
        for child in self.children:
            if not child.has_started and child.exited() is None and now - child.started_at >= STARTED_AFTER_S:
                child.has_started = True

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
                if code != 0 and not child.has_started:
                    # A configuration problem (bad option, port taken, settings): restarting
                    # would only repeat it forever.
                    logger.error("%s failed to start (exit %s; see above)", child.name, code)
                    return 1
                if child.name not in due:
                    _metrics_process_dead(child)
                    delay = child.restart_delay()
                    logger.warning("%s exited with %s; restarting in %.1fs", child.name, code, delay)
                    due[child.name] = now + delay
                if now >= due[child.name]:
                    del due[child.name]
                    child.start()
            if not self.stopping:
                self._mark_started(now)
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
        if self.postgres is None:
            return
        self.postgres.stop()
        self.postgres.release_lock()
        if self.postgres_started:
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
        try:
            # Archiving on for every start of this data dir, or its WAL would have a gap.
            postgres.server_settings = _command_archive_settings(settings.DATA_DIR)
            postgres.start()
        except (RuntimeError, OSError) as exc:  # BackupError included; never the command's own
            raise SystemExit(f"manage.py: the embedded database did not start: {exc}") from None
        yield
    finally:
        postgres.stop()
        postgres.release_lock()


def _command_archive_settings(data_dir: Path) -> dict[str, str]:
    """The archive settings for a manage.py command's own start of the database. A backup
    target that is down (S3 unreachable) does not stop the command, which is how an
    operator inspects and repairs things meanwhile: archiving stays on, Postgres keeps the
    segments the command writes until they can be archived, so the WAL has no gap. The
    service still refuses to start until the target answers."""
    from memsite.backup import BackupError, server_settings

    try:
        return server_settings(data_dir)
    except BackupError as exc:
        sys.stderr.write(
            f"manage.py: warning: {exc}. WAL archiving stays on: Postgres keeps the WAL this command "
            "writes until it can be archived (the service will not start until then).\n"
        )
        return server_settings(data_dir, check=False)


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
