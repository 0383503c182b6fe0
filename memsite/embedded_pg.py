"""Embedded PostgreSQL 16 + pgvector, from the binaries of the `pgserver` package.

We use pgserver only for its binaries (and its `pgserver` user convention as root). The server
runs as a direct child of whoever starts it (the launcher, a management command, the
test session) with a parent-death signal, so that a parent killed with SIGKILL never
leaves a postmaster behind; pgserver's own pg_ctl daemon plus pid list cannot promise
that. Unix socket only, no TCP listener.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.util
import logging
import os
import pwd
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DATABASE_NAME = "memsite"
SUPERUSER = "postgres"
SYSTEM_USER = "pgserver"
_PR_SET_PDEATHSIG = 1
_SOCKET_NAME = ".s.PGSQL.5432"
_MAX_SOCKET_PATH = 100  # sun_path is 108 bytes on Linux; keep a margin.


def set_parent_death_signal(sig: int) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _bin_dir() -> Path:
    # Located without importing pgserver, whose import touches runtime dirs.
    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the pgserver package is not installed (pip install -r requirements.txt)")
    return Path(spec.submodule_search_locations[0]) / "pginstall" / "bin"


@dataclass(frozen=True)
class EmbeddedPaths:
    data_dir: Path

    @property
    def pgdata(self) -> Path:
        return self.data_dir / "postgres"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "logs" / "postgres.log"

    @property
    def lock_file(self) -> Path:
        return self.data_dir / "embedded-postgres.lock"

    @property
    def socket_dir(self) -> Path:
        preferred = self.data_dir / "run"
        if len(str(preferred / _SOCKET_NAME)) <= _MAX_SOCKET_PATH:
            return preferred
        digest = hashlib.sha256(str(self.data_dir).encode()).hexdigest()[:12]
        return Path("/tmp") / f"memsite-pg-{digest}"


def django_database_settings(data_dir: Path) -> dict:
    paths = EmbeddedPaths(data_dir)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": DATABASE_NAME,
        "USER": SUPERUSER,
        "HOST": str(paths.socket_dir),
        "PORT": "",
    }


def _system_user() -> str | None:
    """postgres refuses to run as root; like pgserver, run it as a `pgserver` user."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", SYSTEM_USER], check=True, capture_output=True)
    return SYSTEM_USER


def _run_as(user: str | None) -> dict:
    """subprocess arguments to drop to `user` entirely (its group too, not root's)."""
    if user is None:
        return {}
    entry = pwd.getpwnam(user)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _allow_traversal(path: Path) -> None:
    """o+rx on every parent, so the postgres user can reach `path`."""
    for parent in path.parents:
        mode = parent.stat().st_mode
        if mode & 0o005 != 0o005:
            parent.chmod(mode | 0o005)


def _grant_to(user: str, *paths: Path) -> None:
    entry = pwd.getpwnam(user)
    install = _bin_dir().parent
    _allow_traversal(install)
    for dirpath, dirnames, filenames in os.walk(install):
        for name in dirnames + filenames:
            target = Path(dirpath) / name
            mode = target.stat().st_mode
            wanted = mode | (0o055 if target.is_dir() or mode & 0o100 else 0o044)
            if wanted != mode:
                target.chmod(wanted)
    for path in paths:
        _allow_traversal(path)
        os.chown(path, entry.pw_uid, entry.pw_gid)


class EmbeddedPostgres:
    """One postmaster owned by this process. Use `start()` then `stop()`."""

    def __init__(self, data_dir: Path):
        self.paths = EmbeddedPaths(data_dir)
        self.process: subprocess.Popen | None = None
        self._lock_fd: int | None = None

    # -- ownership ---------------------------------------------------------------
    def try_lock(self) -> bool:
        """Exclusive ownership of this data dir; released by the kernel on any exit."""
        self.paths.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.paths.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.set_inheritable(fd, False)
        self._lock_fd = fd
        return True

    def release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- lifecycle ---------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> None:
        user = _system_user()
        self._prepare_dirs(user)
        if not (self.paths.pgdata / "PG_VERSION").exists():
            self._initdb(user)
        self._remove_stale_pidfile()
        self._spawn(user)
        self._wait_ready(timeout)
        self._ensure_database()

    def stop(self, timeout: float = 30.0) -> None:
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)  # "fast" shutdown: clean, no waiting on clients
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGQUIT)
            proc.wait(10)
        self.process = None

    def _prepare_dirs(self, user: str | None) -> None:
        for path in (self.paths.pgdata, self.paths.socket_dir, self.paths.log_file.parent):
            path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.paths.pgdata, 0o700)
        if user:
            _grant_to(user, self.paths.pgdata, self.paths.socket_dir)

    def _initdb(self, user: str | None) -> None:
        logger.info("initialising embedded postgres in %s", self.paths.pgdata)
        result = subprocess.run(
            [
                str(_bin_dir() / "initdb"),
                "-D",
                str(self.paths.pgdata),
                "--auth=trust",
                "--encoding=utf8",
                "--locale=C",
                "-U",
                SUPERUSER,
            ],
            capture_output=True,
            **_run_as(user),
        )
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed: {result.stderr.decode(errors='replace').strip()}")

    def _remove_stale_pidfile(self) -> None:
        """A postmaster killed with SIGKILL leaves postmaster.pid; its pid may be reused."""
        pidfile = self.paths.pgdata / "postmaster.pid"
        if not pidfile.exists():
            return
        try:
            pid = int(pidfile.read_text().splitlines()[0])
        except (ValueError, IndexError, OSError):
            pid = None
        if pid and _is_postgres(pid):
            raise RuntimeError(f"a postgres (pid {pid}) already runs on {self.paths.pgdata} outside our lock")
        logger.warning("removing stale %s (pid %s is gone)", pidfile, pid)
        pidfile.unlink(missing_ok=True)

    def _spawn(self, user: str | None) -> None:
        log = open(self.paths.log_file, "ab")  # noqa: SIM115 - handed to the child
        self.process = subprocess.Popen(
            [
                str(_bin_dir() / "postgres"),
                "-D",
                str(self.paths.pgdata),
                "-k",
                str(self.paths.socket_dir),
                "-h",
                "",
                "-c",
                "max_connections=200",
                "-c",
                "shared_buffers=128MB",
                "-c",
                "fsync=on",
                # No DETAIL/CONTEXT lines and no failing statement in the server log: they
                # quote the data it carried (memory text in `CONTEXT: JSON data ...`, and
                # Django binds parameters client-side, so STATEMENT holds the values).
                "-c",
                "log_error_verbosity=terse",
                "-c",
                "log_min_error_statement=panic",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            **_run_as(user),
            preexec_fn=lambda: set_parent_death_signal(signal.SIGINT),
            start_new_session=True,
        )
        log.close()

    def _wait_ready(self, timeout: float) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"embedded postgres exited with {self.process.returncode}; see {self.paths.log_file}"
                )
            try:
                psycopg.connect(self.conninfo("postgres"), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"embedded postgres not ready after {timeout}s; see {self.paths.log_file}"
                    ) from None
                time.sleep(0.1)

    def conninfo(self, database: str = DATABASE_NAME) -> str:
        return f"host={self.paths.socket_dir} user={SUPERUSER} dbname={database}"

    def _ensure_database(self) -> None:
        import psycopg

        with psycopg.connect(self.conninfo("postgres"), autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE_NAME,)).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{DATABASE_NAME}"')


def _is_postgres(pid: int) -> bool:
    try:
        import psutil

        return psutil.Process(pid).name() == "postgres"
    except Exception:
        return False


def is_answering(data_dir: Path) -> bool:
    import psycopg

    try:
        psycopg.connect(EmbeddedPostgres(data_dir).conninfo("postgres"), connect_timeout=2).close()
    except psycopg.OperationalError:
        return False
    return True
