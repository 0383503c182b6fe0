"""Backups of the embedded Postgres: continuous WAL archiving plus base backups, and
point-in-time restore. Postgres' own tools only (archive_command, pg_basebackup, recovery).

- Every WAL segment is archived by `memsite/walarchive.py`, which Postgres runs as its
  archive_command; `archive_timeout` (BACKUP_ARCHIVE_TIMEOUT_S) forces a segment switch when
  there were writes, so at most that much acknowledged work is at risk (the RPO).
- Base backups (`pg_basebackup`, tar + gzip, with the WAL they need) are taken by
  `manage.py backup`, by the launcher when none is recent, and by Celery beat.
- `restore` unpacks the newest base backup finished before the target time into a fresh data
  dir and lets Postgres replay archived WAL up to that time (or to the end: "latest").

Target: a directory (BACKUP_DIR, default $MEMSITE_DATA_DIR/backups) or an S3-compatible bucket
with object lock (BACKUP_S3_*). Layout in both: `base/<label>/{base.tar.gz, pg_wal.tar.gz,
backup_manifest, backup.json}` (backup.json written last: a backup without it is incomplete),
`wal/<segment>.gz` and `erasures/<utc time>-<id>.json`, the erasure ledger (memsite/services.py):
a restore to a point before an erasure does it again at the restored instance's first start
(the restore leaves `erasures-reapply.json` in the data dir for that).

With DATABASE_URL (an external Postgres) none of this runs: the operator configures the
provider's point-in-time recovery or pgBackRest on that server (README, "Backups").
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from memsite import walarchive
from memsite.embedded_pg import EmbeddedPostgres, pg_bin_dir, postgres_os_user

Progress = Callable[[str], None]
BASE_FILES = ("base.tar.gz", "pg_wal.tar.gz", "backup_manifest")
META = "backup.json"
CONFIG_NAME = "wal-archive.json"
ERASURES = "erasures"
# In a restored data dir until the erasures after its recovery point are re-applied.
REAPPLY_MARKER = "erasures-reapply.json"
_STAMP = "%Y%m%dT%H%M%S%fZ"  # fixed width: names sort by time
# An erasure's time is taken inside its transaction, before its commit: one whose transaction
# was still open at the recovery point has a time just before that point and is not in the
# restored data. The ledger's rows in the database decide exactly which are; this margin only
# bounds which records are read.
REAPPLY_MARGIN = timedelta(minutes=10)
_SEGMENT = re.compile(r"^[0-9A-F]{24}$")


class BackupError(RuntimeError):
    """A backup or restore that cannot proceed; the message says why and what to do."""


class BackupBusy(BackupError):
    pass


def _quiet(_: str) -> None:
    pass


# -- configuration ------------------------------------------------------------------------
def target_config() -> dict:
    """The archive target from settings, as walarchive.py reads it."""
    from django.conf import settings

    if settings.BACKUP_S3_BUCKET:
        return {
            "kind": "s3",
            "bucket": settings.BACKUP_S3_BUCKET,
            "prefix": settings.BACKUP_S3_PREFIX,
            "endpoint_url": settings.BACKUP_S3_ENDPOINT_URL,
            "access_key": settings.BACKUP_S3_ACCESS_KEY_ID,
            "secret_key": settings.BACKUP_S3_SECRET_ACCESS_KEY,
            "region": settings.BACKUP_S3_REGION,
            "addressing_style": settings.BACKUP_S3_ADDRESSING_STYLE,
            "lock_mode": settings.BACKUP_OBJECT_LOCK_MODE,
            "lock_days": settings.BACKUP_OBJECT_LOCK_DAYS,
        }
    return {"kind": "dir", "path": str(settings.BACKUP_DIR)}


def describe(config: dict) -> str:
    if config["kind"] == "s3":
        return f"s3://{config['bucket']}/{(config.get('prefix') or '').strip('/')}"
    return config["path"]


def _grant_traversal(path: Path) -> None:
    """o+x on every parent directory, so the server's OS user can reach `path` (not list)."""
    for parent in path.parents:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            parent.chmod(mode | 0o001)


def _write_config(data_dir: Path, config: dict, user: str | None, name: str = CONFIG_NAME) -> Path:
    """The target, for the server's archive/restore command: 0600, owned by the server's user."""
    path = data_dir / name
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(config))
    tmp.chmod(0o600)
    if user:
        entry = pwd.getpwnam(user)
        os.chown(tmp, entry.pw_uid, entry.pw_gid)
    tmp.replace(path)
    if user:
        _grant_traversal(path)
    return path


def _prepare_target(config: dict, user: str | None) -> None:
    if config["kind"] != "dir":
        return
    wal = Path(config["path"]) / "wal"
    wal.mkdir(parents=True, exist_ok=True)
    (Path(config["path"]) / "base").mkdir(exist_ok=True)
    if user:
        entry = pwd.getpwnam(user)
        os.chown(wal, entry.pw_uid, entry.pw_gid)
        _grant_traversal(wal)


def _command(verb: str, config_path: Path) -> str:
    """A shell command line for Postgres; `%` in our paths doubled so only %p/%f expand."""
    script = Path(walarchive.__file__).resolve()
    line = shlex.join([sys.executable, str(script), verb, str(config_path)])
    return line.replace("%", "%%") + (" %p %f" if verb == "push" else " %f %p")


def _check_runs_as(user: str | None, config_path: Path) -> None:
    """archive_command runs as the server's user: prove now that it can, not at the first segment."""
    if not user:
        return
    _grant_traversal(Path(sys.executable).resolve())
    _grant_traversal(Path(walarchive.__file__).resolve())
    entry = pwd.getpwnam(user)
    probe = subprocess.run(
        [sys.executable, str(Path(walarchive.__file__).resolve()), "fetch", str(config_path), "probe", "/dev/null"],
        capture_output=True,
        user=entry.pw_uid,
        group=entry.pw_gid,
        extra_groups=[],
        text=True,
    )
    if probe.returncode not in (0, 1) or "failed" in probe.stderr:
        raise BackupError(f"the WAL archive command cannot run as {user!r}: {probe.stderr.strip()[-500:]}")


def server_settings(data_dir: Path, *, archive: bool = True) -> dict[str, str]:
    """`-c` settings for the embedded server on `data_dir`: WAL archiving when backups are on.

    Called for every start of the server (launcher, manage.py), so no segment goes unarchived."""
    from django.conf import settings

    if not settings.BACKUP_ENABLED or not archive:
        return {}
    user = postgres_os_user()
    config = target_config()
    _prepare_target(config, user)
    config_path = _write_config(data_dir, config, user)
    _check_runs_as(user, config_path)
    return {
        "wal_level": "replica",
        "archive_mode": "on",
        "archive_command": _command("push", config_path),
        "archive_timeout": str(settings.BACKUP_ARCHIVE_TIMEOUT_S),
    }


# -- targets ------------------------------------------------------------------------------
class _DirTarget:
    def __init__(self, config: dict):
        self.root = Path(config["path"])

    def base_labels(self) -> list[str]:
        base = self.root / "base"
        if not base.exists():
            return []
        # .partial-* is a backup being written (or left by one killed): not a backup.
        return sorted(p.name for p in base.iterdir() if not p.name.startswith(".") and (p / META).exists())

    def read_meta(self, label: str) -> dict:
        return json.loads((self.root / "base" / label / META).read_text())

    def store_base(self, label: str, staging: Path, progress: Progress) -> None:
        final = self.root / "base" / label
        # Staging is already under base/ (same file system): a rename publishes it whole.
        for name in (*BASE_FILES, META):
            with open(staging / name, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_path(staging)
        staging.rename(final)
        _fsync_path(final.parent)
        progress(f"stored in {final}")

    def fetch_base_file(self, label: str, name: str, dest: Path) -> None:
        shutil.copyfile(self.root / "base" / label / name, dest)

    def wal_names(self) -> list[tuple[str, float]]:
        wal = self.root / "wal"
        if not wal.exists():
            return []
        return sorted((p.name.removesuffix(".gz"), p.stat().st_mtime) for p in wal.glob("*.gz"))

    def delete_base(self, label: str) -> None:
        shutil.rmtree(self.root / "base" / label)

    def delete_wal(self, name: str) -> None:
        (self.root / "wal" / f"{name}.gz").unlink(missing_ok=True)

    def erasure_names(self) -> list[str]:
        folder = self.root / ERASURES
        if not folder.exists():
            return []
        return sorted(p.name for p in folder.glob("*.json") if not p.name.startswith("."))

    def read_erasure(self, name: str) -> dict:
        return json.loads((self.root / ERASURES / name).read_text())

    def store_erasure(self, name: str, body: bytes) -> None:
        """Durable before it returns: the file fsynced, then linked under its name (never
        replacing one: the same name again is fine only with the same bytes), then the
        directory fsynced (and the target's, when erasures/ is new)."""
        folder = self.root / ERASURES
        if not folder.exists():
            folder.mkdir(parents=True, exist_ok=True)
            _fsync_path(self.root)
        dest = folder / name
        fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(body)
                out.flush()
                os.fsync(out.fileno())
            try:
                os.link(tmp_name, dest)
            except FileExistsError:
                if dest.read_bytes() != body:
                    raise BackupError(f"{dest} exists with different content; refusing to overwrite") from None
        finally:
            os.unlink(tmp_name)
        _fsync_path(folder)

    def delete_erasure(self, name: str) -> None:
        (self.root / ERASURES / name).unlink(missing_ok=True)

    def staging_dir(self, label: str) -> Path:
        path = self.root / "base" / f".partial-{label}"
        shutil.rmtree(path, ignore_errors=True)
        for stale in (self.root / "base").glob(".partial-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a backup that was killed
        path.mkdir(parents=True)
        return path


class _S3Target:
    def __init__(self, config: dict):
        self.config = config
        self.client = walarchive.s3_client(config)

    def _list(self, prefix: str) -> list[dict]:
        paginator = self.client.get_paginator("list_objects_v2")
        full = walarchive.s3_key(self.config, prefix)
        pages = paginator.paginate(Bucket=self.config["bucket"], Prefix=full)
        return [obj for page in pages for obj in page.get("Contents", [])]

    def base_labels(self) -> list[str]:
        return sorted(o["Key"].split("/")[-2] for o in self._list("base/") if o["Key"].endswith(f"/{META}"))

    def read_meta(self, label: str) -> dict:
        key = walarchive.s3_key(self.config, f"base/{label}/{META}")
        return json.loads(self.client.get_object(Bucket=self.config["bucket"], Key=key)["Body"].read())

    def store_base(self, label: str, staging: Path, progress: Progress) -> None:
        for name in (*BASE_FILES, META):  # backup.json last: its presence means complete
            progress(f"uploading {name} ({(staging / name).stat().st_size / 1e6:.1f} MB)")
            with open(staging / name, "rb") as body:
                walarchive.s3_put(self.client, self.config, f"base/{label}/{name}", body)
        shutil.rmtree(staging)
        progress(f"stored in {describe(self.config)}/base/{label}")

    def fetch_base_file(self, label: str, name: str, dest: Path) -> None:
        key = walarchive.s3_key(self.config, f"base/{label}/{name}")
        self.client.download_file(self.config["bucket"], key, str(dest))

    def wal_names(self) -> list[tuple[str, float]]:
        return sorted(
            (o["Key"].rsplit("/", 1)[-1].removesuffix(".gz"), o["LastModified"].timestamp()) for o in self._list("wal/")
        )

    def fetch_wal_gz(self, name: str, dest: Path) -> None:
        self.client.download_file(self.config["bucket"], walarchive.s3_key(self.config, f"wal/{name}.gz"), str(dest))

    def erasure_names(self) -> list[str]:
        return sorted(o["Key"].rsplit("/", 1)[-1] for o in self._list(f"{ERASURES}/") if o["Key"].endswith(".json"))

    def read_erasure(self, name: str) -> dict:
        key = walarchive.s3_key(self.config, f"{ERASURES}/{name}")
        return json.loads(self.client.get_object(Bucket=self.config["bucket"], Key=key)["Body"].read())

    def store_erasure(self, name: str, body: bytes) -> None:
        # One PUT under object lock (Content-MD5 checked): kept at least as long as the
        # backups written before it, which expire by the same lifecycle rule.
        walarchive.s3_put(self.client, self.config, f"{ERASURES}/{name}", body)

    def delete_base(self, label: str) -> None:
        raise BackupError("old backups in S3 expire by the bucket's lifecycle rules, not by memsite")

    delete_wal = delete_base

    def staging_dir(self, label: str) -> Path:
        from django.conf import settings

        path = settings.DATA_DIR / "backup-staging" / label
        shutil.rmtree(path.parent, ignore_errors=True)
        path.mkdir(parents=True)
        return path


def _target(config: dict | None = None):
    config = config or target_config()
    return _S3Target(config) if config["kind"] == "s3" else _DirTarget(config)


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- base backups -----------------------------------------------------------------------------
def _embedded_only() -> None:
    from django.conf import settings

    if not settings.EMBEDDED_DATABASE:
        raise BackupError(
            "DATABASE_URL is set: back up that server with its own point-in-time recovery "
            "(managed provider PITR, or pgBackRest/barman on it); see README, Backups"
        )


@contextlib.contextmanager
def _backup_lock() -> Iterator[None]:
    from django.conf import settings

    settings.DATA_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(settings.DATA_DIR / "backup.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BackupBusy("another base backup is running") from None
        yield
    finally:
        os.close(fd)


def _conninfo() -> str:
    from django.conf import settings

    return EmbeddedPostgres(settings.DATA_DIR).conninfo("postgres")


def _server_facts() -> dict:
    import psycopg

    with psycopg.connect(_conninfo(), autocommit=True) as conn:
        row = conn.execute(
            "SELECT current_setting('archive_mode'), current_setting('server_version'),"
            " (SELECT setting::bigint FROM pg_settings WHERE name = 'wal_segment_size'),"  # bytes since PG 11
            " (SELECT last_failed_time > coalesce(last_archived_time, 'epoch') FROM pg_stat_archiver)"
        ).fetchone()
    assert row is not None  # one row from a SELECT without FROM
    return {"archive_mode": row[0], "server_version": row[1], "wal_segment_size": row[2], "archive_failing": row[3]}


def _lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def wal_file_name(timeline: int, lsn: int, segment_size: int) -> str:
    segno = lsn // segment_size
    per_id = 0x100000000 // segment_size
    return f"{timeline:08X}{segno // per_id:08X}{segno % per_id:08X}"


def _run_with_progress(argv: list[str], progress: Progress) -> None:
    """pg_basebackup -P redraws one line with \\r: pass on about one line per second."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    buffer, last_sent = b"", 0.0
    tail: list[str] = []
    assert proc.stderr is not None
    while chunk := proc.stderr.read1(4096):  # type: ignore[attr-defined]  # a BufferedReader
        buffer += chunk
        *lines, buffer = re.split(rb"[\r\n]", buffer)
        for raw in lines:
            line = raw.decode(errors="replace").strip()
            if not line:
                continue
            tail = (tail + [line])[-5:]
            if time.monotonic() - last_sent > 1 or "kB" not in line:
                progress(line)
                last_sent = time.monotonic()
    if proc.wait() != 0:
        raise BackupError(f"pg_basebackup failed ({proc.returncode}): {' | '.join(tail)}")


def backup_base(*, progress: Progress = _quiet) -> dict:
    """Take a base backup now and store it in the target; returns its backup.json."""
    from django.conf import settings

    _embedded_only()
    config = target_config()
    target = _target(config)
    with _backup_lock():
        facts = _server_facts()
        if facts["archive_mode"] != "on":
            progress("warning: WAL archiving is off (BACKUP_ENABLED=false?): this backup restores only to its own end")
        if facts["archive_failing"]:
            progress("warning: the last WAL archive attempt failed; see the postgres log")
        label = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        staging = target.staging_dir(label)
        started = datetime.now(UTC)
        progress(f"base backup {label} -> {describe(config)}")
        paths = EmbeddedPostgres(settings.DATA_DIR).paths
        _run_with_progress(
            [
                str(pg_bin_dir() / "pg_basebackup"),
                "-h", str(paths.socket_dir), "-U", "postgres",
                "-D", str(staging), "-Ft", "-z", "-X", "stream", "--checkpoint=fast",
                "-P", "-l", f"memsite {label}",
            ],
            progress,
        )  # fmt: skip
        finished = datetime.now(UTC)
        manifest = json.loads((staging / "backup_manifest").read_text())
        wal_range = manifest["WAL-Ranges"][0]
        timeline, start_lsn = int(wal_range["Timeline"]), _lsn(wal_range["Start-LSN"])
        files = {}
        for name in BASE_FILES:
            files[name] = {"size": (staging / name).stat().st_size, "sha256": _sha256(staging / name)}
        meta = {
            "label": label,
            "started_at": started.isoformat(),
            "finished_at": finished.isoformat(),
            "timeline": timeline,
            "start_lsn": wal_range["Start-LSN"],
            "end_lsn": wal_range["End-LSN"],
            "start_wal": wal_file_name(timeline, start_lsn, facts["wal_segment_size"]),
            "server_version": facts["server_version"],
            "files": files,
        }
        (staging / META).write_text(json.dumps(meta, indent=2))
        target.store_base(label, staging, progress)
        if config["kind"] == "dir":
            _apply_retention(target, settings.BACKUP_KEEP, progress)
    size = sum(f["size"] for f in files.values())
    progress(f"done: {label}, {size / 1e6:.1f} MB in {(finished - started).total_seconds():.1f} s")
    return meta


def backup_base_if_due(*, progress: Progress = _quiet) -> dict | None:
    """A base backup when the newest one is older than BACKUP_BASE_INTERVAL_H (or there is none)."""
    from django.conf import settings

    if not settings.BACKUP_ENABLED or not settings.EMBEDDED_DATABASE:
        return None
    newest = backups_list()[-1:] or None
    if newest:
        age_h = (datetime.now(UTC) - datetime.fromisoformat(newest[0]["finished_at"])).total_seconds() / 3600
        if age_h < settings.BACKUP_BASE_INTERVAL_H:
            return None
    try:
        return backup_base(progress=progress)
    except BackupBusy:
        return None  # the launcher's or beat's run is taking it


def _apply_retention(target: _DirTarget, keep: int, progress: Progress) -> None:
    """Keep the newest `keep` base backups and the WAL from the oldest of them on."""
    labels = target.base_labels()
    if keep <= 0 or len(labels) <= keep:
        return
    for label in labels[:-keep]:
        target.delete_base(label)
        progress(f"retention: removed base backup {label}")
    oldest_meta = target.read_meta(labels[-keep])
    oldest = oldest_meta["start_wal"]
    # A ledger record matters only to a restore from a backup started before it: none is
    # left for those a day older than the oldest kept one (the day: erasures in flight).
    horizon = (datetime.fromisoformat(oldest_meta["started_at"]) - timedelta(days=1)).strftime(_STAMP)
    for name in target.erasure_names():
        if name[: len(horizon)] < horizon:
            target.delete_erasure(name)
    removed = 0
    for name, _ in target.wal_names():
        # Segment (and .backup) names sort by log/segment after the timeline; history files stay.
        if _SEGMENT.match(name[:24]) and not name.endswith(".history") and name[8:24] < oldest[8:24]:
            target.delete_wal(name)
            removed += 1
    if removed:
        progress(f"retention: removed {removed} WAL files before {oldest}")


@dataclass
class ArchiveStatus:
    target: str
    backups: list[dict]
    wal_files: int
    newest_wal: str | None
    newest_wal_at: datetime | None
    archiver: dict | None = None  # pg_stat_archiver of the running server, if it answers


def backups_list() -> list[dict]:
    """backup.json of every complete base backup, oldest first."""
    target = _target()
    return [target.read_meta(label) for label in target.base_labels()]


def archive_status() -> ArchiveStatus:
    config = target_config()
    target = _target(config)
    wal = [(n, t) for n, t in target.wal_names() if _SEGMENT.match(n)]
    newest = max(wal, key=lambda item: item[1]) if wal else None
    return ArchiveStatus(
        target=describe(config),
        backups=[target.read_meta(label) for label in target.base_labels()],
        wal_files=len(wal),
        newest_wal=newest[0] if newest else None,
        newest_wal_at=datetime.fromtimestamp(newest[1], UTC) if newest else None,
        archiver=_archiver_stats(),
    )


def _archiver_stats() -> dict | None:
    import psycopg

    try:
        with psycopg.connect(_conninfo(), autocommit=True, connect_timeout=2) as conn:
            cursor = conn.execute(
                "SELECT current_setting('archive_mode') AS archive_mode, archived_count, last_archived_wal,"
                " last_archived_time, failed_count, last_failed_wal, last_failed_time FROM pg_stat_archiver"
            )
            names = [c.name for c in cursor.description or ()]
            return dict(zip(names, cursor.fetchone() or (), strict=True))
    except psycopg.Error:
        return None


# -- the erasure ledger ------------------------------------------------------------------------
def erasure_record_name(*, erased_at: datetime, ledger_id: str) -> str:
    return f"{erased_at.astimezone(UTC).strftime(_STAMP)}-{ledger_id}.json"


def erasure_record_store(*, name: str, record: dict) -> None:
    """Store one ledger record durably in the backup target (slow: call it outside a
    transaction). Storing the same record again is harmless."""
    _embedded_only()
    _target().store_erasure(name, json.dumps(record, sort_keys=True).encode())


def erasure_records(*, after: datetime | None = None, progress: Progress = _quiet) -> list[dict]:
    """The ledger's records whose name (their erasure's time) is not before `after`, oldest first."""
    from concurrent.futures import ThreadPoolExecutor

    target = _target()
    names = target.erasure_names()
    if after is not None:
        stamp = after.astimezone(UTC).strftime(_STAMP)
        names = [n for n in names if n[: len(stamp)] >= stamp]
    progress(f"reading {len(names)} erasure ledger records from {describe(target_config())}/{ERASURES}")

    def read(name: str) -> dict:
        try:
            return target.read_erasure(name)
        except Exception as exc:  # one unreadable record must name itself, not stop on a traceback
            raise BackupError(f"erasure ledger record {ERASURES}/{name} is unreadable ({type(exc).__name__})") from None

    with ThreadPoolExecutor(max_workers=8) as pool:  # a bucket answers each GET in tens of ms
        return list(pool.map(read, names))


def _write_durably(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as out:
        out.write(json.dumps(data, indent=2))
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(path)
    _fsync_path(path.parent)


def erasure_reapply_marker(data_dir: Path | None = None) -> dict | None:
    """What a restore left in `data_dir` (default: this instance's) for the erasures it must
    re-apply: {"backup", "backup_started_at", "recovery_point"}; None when nothing is pending."""
    from django.conf import settings

    path = Path(data_dir or settings.DATA_DIR) / REAPPLY_MARKER
    return json.loads(path.read_text()) if path.exists() else None


def erasure_reapply_marker_clear(data_dir: Path | None = None) -> None:
    from django.conf import settings

    path = Path(data_dir or settings.DATA_DIR) / REAPPLY_MARKER
    path.unlink(missing_ok=True)
    _fsync_path(path.parent)


# -- restore ------------------------------------------------------------------------------------
@dataclass
class RestoreReport:
    backup: str
    data_dir: Path
    target: str
    recovery_point: datetime | None
    segments_replayed: int
    elapsed_s: float
    notes: list[str] = field(default_factory=list)


def _choose_backup(backups: list[dict], target_time: datetime | None) -> dict:
    if not backups:
        raise BackupError("there is no complete base backup in the target to restore from")
    if target_time is None:
        return backups[-1]
    usable = [b for b in backups if datetime.fromisoformat(b["finished_at"]) <= target_time]
    if not usable:
        raise BackupError(f"no base backup finished before {target_time.isoformat()}; the oldest finished at "
                          f"{backups[0]['finished_at']}")  # fmt: skip
    return usable[-1]


def _unpack(target, meta: dict, pgdata: Path, progress: Progress) -> None:
    with tempfile.TemporaryDirectory(dir=pgdata.parent, prefix=".restore-") as tmp:
        for name in ("base.tar.gz", "pg_wal.tar.gz"):
            local = Path(tmp) / name
            progress(f"fetching {name} ({meta['files'][name]['size'] / 1e6:.1f} MB)")
            target.fetch_base_file(meta["label"], name, local)
            digest = _sha256(local)
            if digest != meta["files"][name]["sha256"]:
                raise BackupError(f"{name} of backup {meta['label']} is corrupt (sha256 mismatch)")
            destination = pgdata if name == "base.tar.gz" else pgdata / "pg_wal"
            destination.mkdir(parents=True, exist_ok=True)
            progress(f"unpacking {name}")
            with tarfile.open(local) as archive:
                archive.extractall(destination, filter="data")
    (pgdata / "recovery.signal").touch()
    for leftover in ("postmaster.pid", "postmaster.opts"):
        (pgdata / leftover).unlink(missing_ok=True)


def _prefetch_wal(target: _S3Target, meta: dict, spool: Path, progress: Progress) -> dict:
    """From a bucket: download the WAL recovery will ask for first, in parallel, so that Postgres'
    restore_command reads local files instead of starting boto3 once per segment."""
    from concurrent.futures import ThreadPoolExecutor

    names = [n for n, _ in target.wal_names() if n.endswith(".history") or n[8:24] >= meta["start_wal"][8:24]]
    (spool / "wal").mkdir(parents=True, exist_ok=True)
    progress(f"downloading {len(names)} WAL files")
    with ThreadPoolExecutor(max_workers=8) as pool:
        for done, _ in enumerate(pool.map(lambda n: target.fetch_wal_gz(n, spool / "wal" / f"{n}.gz"), names), 1):
            if done % 50 == 0:
                progress(f"downloaded {done}/{len(names)} WAL files")
    return {"kind": "dir", "path": str(spool)}


def _chown_tree(root: Path, user: str | None) -> None:
    root.chmod(0o700)
    if not user:
        return
    entry = pwd.getpwnam(user)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *dirnames, *filenames]:
            os.chown(Path(dirpath) / name, entry.pw_uid, entry.pw_gid, follow_symlinks=False)


def _fatal_from_log(log_file: Path, since: int) -> str:
    with open(log_file, "rb") as fh:
        fh.seek(since)
        lines = fh.read().decode(errors="replace").splitlines()
    fatal = [line for line in lines if "FATAL" in line or "PANIC" in line]
    return (fatal or lines[-3:] or ["(no log)"])[-1]


def restore(
    *, target_time: datetime | None, data_dir: Path | None = None, progress: Progress = _quiet
) -> RestoreReport:
    """Restore into a fresh `data_dir` (default: this instance's, whose postgres/ must be gone or
    empty) from the newest base backup finished before `target_time` (None = latest), replaying
    archived WAL up to that time, then end recovery (a new timeline) and stop the server."""
    import psycopg
    from django.conf import settings

    _embedded_only()
    started = time.monotonic()
    data_dir = Path(data_dir or settings.DATA_DIR).resolve()
    in_place = data_dir == Path(settings.DATA_DIR).resolve()
    config = target_config()
    target = _target(config)
    server = EmbeddedPostgres(data_dir)
    pgdata = server.paths.pgdata
    if pgdata.exists() and any(pgdata.iterdir()):
        raise BackupError(f"{pgdata} is not empty: restore only into a fresh data dir (move it away, or --target-dir)")
    if not server.try_lock():
        raise BackupError(f"{data_dir} is in use by a running memsite (stop it first)")
    try:
        meta = _choose_backup(backups_list(), target_time)
        progress(f"restoring base backup {meta['label']} (finished {meta['finished_at']}) into {pgdata}")
        wal_total = sum(1 for n, _ in target.wal_names() if _SEGMENT.match(n) and n[8:] >= meta["start_wal"][8:])
        pgdata.mkdir(parents=True, exist_ok=True)
        # Before anything can serve this data dir: the erasures after its recovery point are
        # re-applied at its first start. Written first without the point (a restore cut short
        # still leaves it); the erasure ledger's rows in the database tell exactly which.
        marker = {
            "backup": meta["label"],
            "backup_started_at": meta["started_at"],
            "recovery_point": None,
            "in_place": in_place,
        }
        _write_durably(data_dir / REAPPLY_MARKER, marker)
        _unpack(target, meta, pgdata, progress)
        user = postgres_os_user()
        _chown_tree(pgdata, user)

        # Recovery settings only for this run (-c): nothing is left in postgresql.conf. The
        # instance's own archiving stays on during an in-place restore, so the new timeline's
        # history file is archived; a copy elsewhere must not write into this archive.
        recovery = server_settings(data_dir, archive=in_place)
        spool = data_dir / "restore-wal"
        shutil.rmtree(spool, ignore_errors=True)
        source = config
        if config["kind"] == "s3":
            source = _prefetch_wal(target, meta, spool, progress)
            _chown_tree(spool, user)
        # Its own file: wal-archive.json stays the archive_command's target.
        restore_config = _write_config(data_dir, source, user, name="wal-restore.json")
        _check_runs_as(user, restore_config)
        recovery["restore_command"] = _command("fetch", restore_config)
        recovery["recovery_target_action"] = "promote"
        if target_time is not None:
            recovery["recovery_target_time"] = target_time.isoformat()
        if not in_place:
            recovery["archive_mode"] = "off"
        server.server_settings = recovery
        server.paths.log_file.parent.mkdir(parents=True, exist_ok=True)
        log_offset = server.paths.log_file.stat().st_size if server.paths.log_file.exists() else 0
        progress(f"replaying WAL from {config['kind']} archive ({wal_total} segments after the backup)")
        try:
            server.start(timeout=600)
        except RuntimeError:
            raise BackupError(f"recovery failed: {_fatal_from_log(server.paths.log_file, log_offset)}") from None
        try:
            point = _wait_recovered(server, log_offset, wal_total, progress)
        finally:
            server.stop()
            shutil.rmtree(spool, ignore_errors=True)
        since = (point or datetime.fromisoformat(meta["started_at"])) - REAPPLY_MARGIN
        # The records go into the marker now, from the target this restore read: a copy
        # (--target-dir) serves with a backup target of its own, where they are not.
        records = erasure_records(after=since, progress=progress)
        _write_durably(
            data_dir / REAPPLY_MARKER,
            {**marker, "recovery_point": point.isoformat() if point else None, "records": records},
        )
        report = RestoreReport(
            backup=meta["label"],
            data_dir=data_dir,
            target=target_time.isoformat() if target_time else "latest",
            recovery_point=point,
            segments_replayed=_restored_segments(server.paths.log_file, log_offset),
            elapsed_s=time.monotonic() - started,
        )
        if not in_place:
            report.notes.append(f"WAL archiving was off for this copy; set MEMSITE_DATA_DIR={data_dir} to serve it")
        report.notes.append(
            f"{len(records)} erasure(s) in the ledger around or after the recovery point: the first start of this data "
            f"dir (bin/serve) re-applies those not in the restored data before serving (or now: "
            f"manage.py erasures --reapply)"
        )
        progress(
            f"restored to {point.isoformat() if point else meta['finished_at']} "
            f"({report.segments_replayed} WAL segments) in {report.elapsed_s:.1f} s"
        )
        return report
    except psycopg.Error as exc:
        raise BackupError(f"recovery failed: {type(exc).__name__}") from None
    finally:
        server.release_lock()


def _restored_segments(log_file: Path, since: int) -> int:
    with open(log_file, "rb") as fh:
        fh.seek(since)
        return len(re.findall(rb'restored log file "[0-9A-F]{24}" from archive', fh.read()))


def _wait_recovered(server: EmbeddedPostgres, log_offset: int, wal_total: int, progress: Progress) -> datetime | None:
    import psycopg

    last_said = ""
    while True:
        if server.process is not None and server.process.poll() is not None:
            raise BackupError(f"recovery failed: {_fatal_from_log(server.paths.log_file, log_offset)}")
        with psycopg.connect(server.conninfo("postgres"), autocommit=True) as conn:
            row = conn.execute("SELECT pg_is_in_recovery(), pg_last_xact_replay_timestamp()").fetchone()
            assert row is not None
            in_recovery, replayed_at = row
        if not in_recovery:
            # After promotion this stays at the last transaction recovery applied.
            return replayed_at
        done = _restored_segments(server.paths.log_file, log_offset)
        at = replayed_at.isoformat() if replayed_at else "-"
        said = f"replayed {done} WAL segments (~{wal_total} archived), last transaction at {at}"
        if said != last_said:
            progress(said)
            last_said = said
        time.sleep(0.5)
