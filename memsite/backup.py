"""Backups of the embedded Postgres: continuous WAL archiving plus base backups, and
point-in-time restore. Postgres' own tools only (archive_command, pg_basebackup, recovery).

- Every WAL segment is archived by `memsite/walarchive.py`, which Postgres runs as its
  archive_command; `archive_timeout` (BACKUP_ARCHIVE_TIMEOUT_S) forces a segment switch when
  there were writes, so at most that much acknowledged work is at risk (the RPO).
- Base backups (`pg_basebackup`, tar + gzip, with the WAL they need) are taken by
  `manage.py backup`, by the launcher when none is recent, and by Celery beat.
- `restore` unpacks the newest base backup finished before the target time into a staging dir
  and lets Postgres replay archived WAL up to that time (or to the end: "latest"); the result
  becomes the data dir's postgres/ only when all of it succeeded.

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
import logging
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

logger = logging.getLogger(__name__)

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
# Backups from before backup.json recorded it: initdb's default, never changed by memsite.
DEFAULT_WAL_SEGMENT_SIZE = 16 * 1024 * 1024
# Where a restore unpacks and recovers, inside the data dir it restores into (same file
# system): the result is renamed into place only once recovery succeeded.
RESTORE_STAGING = ".restore-staging"
# Keys asked for per ListObjectsV2 request (S3's own maximum). A bucket holds every WAL
# segment the lifecycle rule keeps (at one a minute, half a million a year): its listings are
# read one page at a time and reduced as they go, never held whole.
S3_LIST_PAGE_SIZE = 1000


class BackupError(RuntimeError):
    """A backup or restore that cannot proceed; the message says why and what to do."""


class BackupBusy(BackupError):
    pass


class BackupUnreadable(BackupError):
    """One base backup's backup.json is damaged: that backup is skipped, the others stay usable."""


def _parse_meta(label: str, raw: bytes) -> dict:
    """backup.json as restore needs it, or BackupUnreadable naming the backup."""
    try:
        meta = json.loads(raw)
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
        for key in ("label", "started_at", "finished_at", "start_wal", "end_lsn", "server_version"):
            if not isinstance(meta.get(key), str):
                raise ValueError(f"no {key}")
        datetime.fromisoformat(meta["started_at"])
        datetime.fromisoformat(meta["finished_at"])
        _lsn(meta["end_lsn"])
        if not _SEGMENT.match(meta["start_wal"]) or not re.match(r"\d+", meta["server_version"]):
            raise ValueError("bad start_wal or server_version")
        for name in BASE_FILES:
            entry = meta["files"][name]
            if not isinstance(entry["sha256"], str) or not isinstance(entry["size"], int):
                raise ValueError(f"bad files.{name}")
    except (ValueError, TypeError, KeyError) as exc:
        reason = type(exc).__name__ if isinstance(exc, json.JSONDecodeError) else f"{type(exc).__name__}: {exc}"
        raise BackupUnreadable(f"base backup {label}: {META} is unreadable ({reason})") from None
    return meta


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
        # Redacted before it is cut: a key the cut split in two would no longer match.
        detail = _secrets_redacted(" ".join(probe.stderr.split()), config_path)[-500:]
        raise BackupError(f"the WAL archive command, run as {user!r}, failed: {detail}")


def _secrets_redacted(text: str, config_path: Path) -> str:
    """`text` without the target's keys or a password in its endpoint URL (a client's error
    may quote its request; walarchive itself never prints the config)."""
    config = json.loads(config_path.read_text())
    for secret in (config.get("secret_key"), config.get("access_key")):
        if secret:
            text = text.replace(secret, "***")
    return re.sub(r"(://)[^/@\s]*@", r"\1***@", text)


def server_settings(data_dir: Path, *, archive: bool = True, check: bool = True) -> dict[str, str]:
    """`-c` settings for the embedded server on `data_dir`: WAL archiving when backups are on.

    Called for every start of the server (launcher, manage.py), so no segment goes unarchived.
    `check`: first prove that the archive command runs as the server's OS user and reaches
    the target (BackupError if not). Without it (a manage.py command while the target is
    down), archiving is on all the same: Postgres keeps each segment until it is archived."""
    from django.conf import settings

    if not settings.BACKUP_ENABLED or not archive:
        return {}
    user = postgres_os_user()
    config = target_config()
    _prepare_target(config, user)
    config_path = _write_config(data_dir, config, user)
    if check:
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
        try:
            raw = (self.root / "base" / label / META).read_bytes()
        except OSError as exc:
            raise BackupUnreadable(f"base backup {label}: {META} is unreadable ({type(exc).__name__})") from None
        return _parse_meta(label, raw)

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
        return sorted(self.wal_entries())

    def wal_entries(self) -> Iterator[tuple[str, float]]:
        """(name, mtime) of every archived WAL file, in no particular order."""
        wal = self.root / "wal"
        if not wal.exists():
            return
        for p in wal.glob("*.gz"):
            yield p.name.removesuffix(".gz"), p.stat().st_mtime

    def delete_base(self, label: str) -> None:
        shutil.rmtree(self.root / "base" / label)

    def delete_wal(self, name: str) -> None:
        (self.root / "wal" / f"{name}.gz").unlink(missing_ok=True)

    def erasure_names(self, after: str = "") -> list[str]:
        """Sorted; only those whose name sorts after `after` (a time stamp prefix)."""
        folder = self.root / ERASURES
        if not folder.exists():
            return []
        return sorted(p.name for p in folder.glob("*.json") if not p.name.startswith(".") and p.name > after)

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

    def _objects(self, prefix: str, *, start_after: str = "") -> Iterator[dict]:
        """The objects under `prefix` in key order, one ListObjectsV2 page at a time (its
        continuation token asks for the next): callers reduce them as they come."""
        full = walarchive.s3_key(self.config, prefix)
        params = {"Bucket": self.config["bucket"], "Prefix": full}
        if start_after:
            params["StartAfter"] = full + start_after
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(**params, PaginationConfig={"PageSize": S3_LIST_PAGE_SIZE}):
            yield from page.get("Contents", [])

    def base_labels(self) -> list[str]:
        return sorted(o["Key"].split("/")[-2] for o in self._objects("base/") if o["Key"].endswith(f"/{META}"))

    def read_meta(self, label: str) -> dict:
        from botocore.exceptions import BotoCoreError, ClientError

        key = walarchive.s3_key(self.config, f"base/{label}/{META}")
        try:
            raw = self.client.get_object(Bucket=self.config["bucket"], Key=key)["Body"].read()
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code in ("404", "NoSuchKey", "NotFound"):
                raise BackupUnreadable(f"base backup {label}: {META} is gone from the bucket") from None
            raise BackupError(f"cannot read {META} of base backup {label} from the bucket ({code})") from None
        except BotoCoreError as exc:
            # The bucket not answering is no reason to skip a backup: stop instead.
            reason = type(exc).__name__
            raise BackupError(f"cannot read {META} of base backup {label} from the bucket ({reason})") from None
        return _parse_meta(label, raw)

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

    def wal_entries(self) -> Iterator[tuple[str, float]]:
        """(name, time stored) of every archived WAL file, in name order."""
        for o in self._objects("wal/"):
            yield o["Key"].rsplit("/", 1)[-1].removesuffix(".gz"), o["LastModified"].timestamp()

    def fetch_wal_gz(self, name: str, dest: Path) -> None:
        self.client.download_file(self.config["bucket"], walarchive.s3_key(self.config, f"wal/{name}.gz"), str(dest))

    def erasure_names(self, after: str = "") -> list[str]:
        """Sorted; only those whose name sorts after `after`, which the bucket skips itself."""
        objects = self._objects(f"{ERASURES}/", start_after=after)
        return sorted(o["Key"].rsplit("/", 1)[-1] for o in objects if o["Key"].endswith(".json"))

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
            "wal_segment_size": facts["wal_segment_size"],
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
    newest = _newest_readable_meta(_target(), progress)
    if newest:
        age_h = (datetime.now(UTC) - datetime.fromisoformat(newest["finished_at"])).total_seconds() / 3600
        if age_h < settings.BACKUP_BASE_INTERVAL_H:
            return None
    try:
        return backup_base(progress=progress)
    except BackupBusy:
        return None  # the launcher's or beat's run is taking it


def _apply_retention(target: _DirTarget, keep: int, progress: Progress) -> None:
    """Keep the newest `keep` readable base backups and the WAL from the oldest of them on.

    Only readable backups count: a damaged backup.json never makes a good backup go."""
    labels = target.base_labels()
    readable, _ = _readable_metas(target, labels, progress)
    if keep <= 0 or len(readable) <= keep:
        return
    oldest_meta = readable[-keep]
    for label in labels:
        if label < oldest_meta["label"]:
            target.delete_base(label)
            progress(f"retention: removed base backup {label}")
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
    unreadable: list[str] = field(default_factory=list)  # why each skipped backup was skipped


def _readable_metas(target, labels: list[str], progress: Progress) -> tuple[list[dict], list[str]]:
    """backup.json of each label that has a readable one; and a message for each that has not."""
    metas, unreadable = [], []
    for label in labels:
        try:
            metas.append(target.read_meta(label))
        except BackupUnreadable as exc:
            logger.warning("%s; skipped", exc)
            progress(f"warning: {exc}; skipped")
            unreadable.append(str(exc))
    return metas, unreadable


def _newest_readable_meta(target, progress: Progress) -> dict | None:
    """backups_list()[-1], reading backup.json newest first: only the newest one, unless it is
    damaged (then the one before, as backups_list skips it)."""
    for label in reversed(target.base_labels()):
        found, _ = _readable_metas(target, [label], progress)
        if found:
            return found[0]
    return None


def _wal_segments(target) -> Iterator[tuple[str, float]]:
    """(name, time stored) of every archived WAL segment (not .history, .backup, .partial)."""
    return ((n, t) for n, t in target.wal_entries() if _SEGMENT.match(n))


def backups_list(*, progress: Progress = _quiet) -> list[dict]:
    """backup.json of every complete base backup, oldest first. One whose backup.json is
    damaged is skipped with a warning: the others stay usable."""
    target = _target()
    return _readable_metas(target, target.base_labels(), progress)[0]


def archive_status() -> ArchiveStatus:
    config = target_config()
    target = _target(config)
    wal_files, newest = 0, None
    for name, stored in _wal_segments(target):
        wal_files += 1
        # The newest by time; of those stored in the same second, the first by name.
        if newest is None or stored > newest[1] or (stored == newest[1] and name < newest[0]):
            newest = (name, stored)
    backups, unreadable = _readable_metas(target, target.base_labels(), _quiet)
    return ArchiveStatus(
        target=describe(config),
        backups=backups,
        unreadable=unreadable,
        wal_files=wal_files,
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
    # Names begin with their erasure's time, fixed width: those after the stamp sort after it.
    names = target.erasure_names(after=after.astimezone(UTC).strftime(_STAMP) if after is not None else "")
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


def _choose_backup(backups: list[dict], target_time: datetime | None, unreadable: list[str]) -> dict:
    if not backups:
        skipped = f" ({'; '.join(unreadable)})" if unreadable else ""
        raise BackupError(f"there is no complete base backup in the target to restore from{skipped}")
    if target_time is None:
        return backups[-1]
    usable = [b for b in backups if datetime.fromisoformat(b["finished_at"]) <= target_time]
    if not usable:
        raise BackupError(f"no base backup finished before {target_time.isoformat()}; the oldest finished at "
                          f"{backups[0]['finished_at']}")  # fmt: skip
    return usable[-1]


def _binaries_major() -> int:
    out = subprocess.run([str(pg_bin_dir() / "postgres"), "--version"], capture_output=True, text=True, check=True)
    found = re.search(r"(\d+)(?:\.\d+)*\s*$", out.stdout.strip())
    if not found:
        raise BackupError(f"cannot tell the version of {pg_bin_dir() / 'postgres'} ({out.stdout.strip()!r})")
    return int(found.group(1))


def _check_server_version(meta: dict) -> None:
    """A physical backup restores only with binaries of its own major version: say so before
    anything is unpacked, not as a server log the operator has to go and read."""
    found = re.match(r"\d+", meta["server_version"])
    major = int(found.group()) if found else None
    ours = _binaries_major()
    if major != ours:
        raise BackupError(
            f"base backup {meta['label']} was taken by PostgreSQL {meta['server_version']} and this memsite runs "
            f"PostgreSQL {ours}: a physical backup restores only with the same major version. Restore it with the "
            f"memsite release that ran PostgreSQL {major}, or restore from a backup taken since the upgrade"
        )


def _segno(name: str, segment_size: int) -> int:
    return int(name[8:16], 16) * (0x100000000 // segment_size) + int(name[16:24], 16)


def _segment_name(timeline: int, segno: int, segment_size: int) -> str:
    return wal_file_name(timeline, segno * segment_size, segment_size)


def _check_wal_complete(wal: list[tuple[str, float]], meta: dict, until: datetime | None, where: str) -> None:
    """Before anything is unpacked: every segment recovery will need is in the archive.

    Recovery takes a segment that is not there for the end of the WAL: a gap would end it
    early and without a word. Needed: from the end of the backup's own WAL (pg_wal.tar.gz) to
    the newest archived segment, or, with a target time, to the first one archived after it.
    Timelines share segment numbers, so any timeline's copy counts as present."""
    size = meta.get("wal_segment_size") or DEFAULT_WAL_SEGMENT_SIZE
    start = _segno(meta["start_wal"], size)
    present = {_segno(n, size): (n, t) for n, t in wal if _segno(n, size) >= start}
    if not present:
        return
    end = max(present)
    if until is not None:
        end = min((s for s, (_, t) in present.items() if t > until.timestamp()), default=end)
    covered = (_lsn(meta["end_lsn"]) - 1) // size
    missing = [s for s in range(covered + 1, end + 1) if s not in present]
    if not missing:
        return
    timeline = int((present.get(missing[0] - 1) or present[end])[0][:8], 16)
    names = ", ".join(_segment_name(timeline, s, size) for s in missing[:3]) + (" ..." if len(missing) > 3 else "")
    before = present.get(missing[0] - 1)
    complete = (
        f"up to {before[0]} (archived at {datetime.fromtimestamp(before[1], UTC).isoformat()})"
        if before
        else f"only to the end of base backup {meta['label']} ({meta['finished_at']})"
    )
    raise BackupError(
        f"the WAL archive has a gap: {len(missing)} segment(s) missing from {where}/wal ({names}), needed to "
        f"replay base backup {meta['label']} up to the target. Nothing was restored. Put the missing segments "
        f"back into the archive (from another copy of the backups); the WAL is complete {complete}. To restore "
        f"only up to the gap, move the archived segments after it aside and restore --to latest"
    )


@dataclass
class _RecoveryEnd:
    replayed_at: datetime | None  # the last transaction recovery applied
    timeline: int  # the timeline recovery followed
    end_lsn: int  # the end of the last WAL record it could read
    new_timeline: int  # the one it ended on (its history file is in pg_wal)
    segment_size: int


def _recovery_end(server: EmbeddedPostgres) -> _RecoveryEnd:
    import psycopg

    with psycopg.connect(server.conninfo("postgres"), autocommit=True) as conn:
        row = conn.execute(
            "SELECT pg_last_xact_replay_timestamp(), pg_walfile_name(pg_current_wal_lsn()),"
            " (SELECT setting::bigint FROM pg_settings WHERE name = 'wal_segment_size')"
        ).fetchone()
        assert row is not None  # a SELECT without FROM
        replayed_at, current, size = row
        history = conn.execute("SELECT pg_read_file(%s)", [f"pg_wal/{current[:8]}.history"]).fetchone()
    assert history is not None
    # Its last line: "<timeline recovery followed> <end of the WAL it read> <why>".
    entries = [line.split() for line in history[0].splitlines() if line.strip() and not line.startswith("#")]
    return _RecoveryEnd(replayed_at, int(entries[-1][0]), _lsn(entries[-1][1]), int(current[:8], 16), size)


def _check_replayed_all(wal: list[tuple[str, float]], end: _RecoveryEnd, where: str) -> None:
    """After a restore to the end: recovery got to the newest archived segment of its timeline.
    Short of it, a segment in between was not there or not valid WAL (Postgres ends recovery
    at the first record it cannot read, as at the end of the WAL)."""
    size = end.segment_size
    prefix = f"{end.timeline:08X}"
    newest = max((n for n, _ in wal if n.startswith(prefix)), default=None)
    last = (end.end_lsn - 1) // size  # the segment holding the end of the last record read
    if newest is None or _segno(newest, size) <= last:
        return
    following = _segment_name(end.timeline, last + 1, size)
    suspect = (
        following if end.end_lsn % size == 0 else f"{_segment_name(end.timeline, last, size)} (the WAL ends inside it)"
    )
    at = end.replayed_at.isoformat() if end.replayed_at else "none"
    raise BackupError(
        f"WAL replay ended at {end.end_lsn >> 32:X}/{end.end_lsn & 0xFFFFFFFF:X} (last transaction at {at}) but "
        f"{where}/wal holds segments up to {newest}: {suspect} is damaged or missing. Nothing was restored. Put a "
        f"good copy back into the archive; to restore only up to there, move the segments from {following} on "
        f"aside and restore --to latest"
    )


_TARGET_NOT_REACHED = "recovery ended before configured recovery target was reached"


def _fatal_from_log(log_file: Path, since: int) -> str | None:
    try:
        with open(log_file, "rb") as fh:
            fh.seek(since)
            lines = fh.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    # A client refused while the server recovers or dies logs a FATAL of its own; that says
    # nothing about why recovery failed, and under load it can be the last one.
    fatal = [
        line
        for line in lines
        if ("FATAL" in line or "PANIC" in line) and not any(noise in line for noise in _CONNECTION_REFUSALS)
    ]
    cause = [line for line in fatal if "could not restore file" in line]
    last = cause or fatal or lines[-3:]
    return last[-1] if last else None


_CONNECTION_REFUSALS = (
    "the database system is in recovery mode",
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is not yet accepting connections",
    "the database system is not accepting connections",
    "terminating connection because of crash of another server process",
)


def _last_transaction(log_file: Path, since: int) -> str | None:
    with contextlib.suppress(FileNotFoundError), open(log_file, "rb") as fh:
        fh.seek(since)
        found = re.findall(rb"last completed transaction was at log time (.+)", fh.read())
        return found[-1].decode(errors="replace").strip() if found else None
    return None


def _restore_command_error(log_file: Path, since: int) -> str | None:
    """What walarchive.py said (the exception, never the config) when it could not fetch a file."""
    with contextlib.suppress(FileNotFoundError), open(log_file, "rb") as fh:
        fh.seek(since)
        found = re.findall(rb"walarchive \['fetch'\] failed: (.+)", fh.read())
        return found[-1].decode(errors="replace").strip() if found else None
    return None


def _recovery_failed(
    log_file: Path, since: int, fallback: str, target_time: datetime | None, kept_log: Path
) -> BackupError:
    line = _fatal_from_log(log_file, since) or fallback
    if _TARGET_NOT_REACHED in line and target_time is not None:
        last = _last_transaction(log_file, since)
        holds = f" (the last one it holds is from {last})" if last else ""
        return BackupError(
            f"the WAL archive holds no transaction after {target_time.isoformat()}{holds}, so recovery cannot stop "
            f"there. Nothing was restored: restore --to latest for everything archived"
        )
    if "could not restore file" in line:
        why = _restore_command_error(log_file, since) or f"see {kept_log}"
        return BackupError(
            f"recovery failed: {line}. An archived WAL file could not be read ({why}). Nothing was restored: "
            f"put a good copy of it back into the archive (readable by the server's OS user), or restore --to "
            f"an earlier time"
        )
    return BackupError(f"recovery failed: {line} (see {kept_log}); nothing was restored")


def _unpack(target, meta: dict, pgdata: Path, progress: Progress) -> None:
    """Every file of the backup fetched and its sha256 checked before any is unpacked."""
    download = pgdata.parent / "download"
    download.mkdir(exist_ok=True)
    for name in BASE_FILES:
        progress(f"fetching {name} ({meta['files'][name]['size'] / 1e6:.1f} MB)")
        try:
            target.fetch_base_file(meta["label"], name, download / name)
        except Exception as exc:  # a file gone or a bucket not answering: name it, no traceback
            raise BackupError(f"cannot fetch {name} of backup {meta['label']} ({type(exc).__name__})") from None
        if _sha256(download / name) != meta["files"][name]["sha256"]:
            raise BackupError(
                f"{name} of backup {meta['label']} is corrupt (sha256 mismatch); nothing was restored. Restore "
                f"--to a time before it finished ({meta['finished_at']}) to use the backup before it"
            )
    for name, destination in (("base.tar.gz", pgdata), ("pg_wal.tar.gz", pgdata / "pg_wal")):
        destination.mkdir(parents=True, exist_ok=True)
        progress(f"unpacking {name}")
        try:
            with tarfile.open(download / name) as archive:
                archive.extractall(destination, filter="data")
        except (OSError, tarfile.TarError) as exc:
            raise BackupError(f"unpacking {name} of backup {meta['label']} failed: {exc}") from None
    shutil.rmtree(download)
    (pgdata / "recovery.signal").touch()
    for leftover in ("postmaster.pid", "postmaster.opts"):
        (pgdata / leftover).unlink(missing_ok=True)


def _prefetch_wal(target: _S3Target, meta: dict, spool: Path, progress: Progress) -> dict:
    """From a bucket: download the WAL recovery will ask for first, in parallel, so that Postgres'
    restore_command reads local files instead of starting boto3 once per segment."""
    from concurrent.futures import ThreadPoolExecutor

    names = [n for n, _ in target.wal_entries() if n.endswith(".history") or n[8:24] >= meta["start_wal"][8:24]]
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


def _keep_log(source: Path, dest: Path) -> None:
    """The recovery's server log goes on in the data dir's own log, where an operator looks."""
    if not source.exists():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as src, open(dest, "ab") as out:
        shutil.copyfileobj(src, out)


def _remove_staging(staging: EmbeddedPostgres) -> None:
    shutil.rmtree(staging.paths.data_dir, ignore_errors=True)
    socket_dir = staging.paths.socket_dir  # under /tmp when the data dir's path is long
    if not socket_dir.is_relative_to(staging.paths.data_dir):
        shutil.rmtree(socket_dir, ignore_errors=True)


def restore(
    *, target_time: datetime | None, data_dir: Path | None = None, progress: Progress = _quiet
) -> RestoreReport:
    """Restore into a fresh `data_dir` (default: this instance's, whose postgres/ must be gone or
    empty) from the newest base backup finished before `target_time` (None = latest), replaying
    archived WAL up to that time, then end recovery (a new timeline) and stop the server.

    Unpacking and recovery happen in a staging dir beside postgres/, moved into place only
    once everything succeeded: a restore that fails (or is killed) leaves no half-restored
    data dir behind, nor anything in the archive, and can simply be run again."""
    from django.conf import settings

    _embedded_only()
    data_dir = Path(data_dir or settings.DATA_DIR).resolve()
    final = EmbeddedPostgres(data_dir)
    pgdata = final.paths.pgdata
    if pgdata.exists() and any(pgdata.iterdir()):
        raise BackupError(f"{pgdata} is not empty: restore only into a fresh data dir (move it away, or --target-dir)")
    if not final.try_lock():
        raise BackupError(f"{data_dir} is in use by a running memsite (stop it first)")
    # upgrade=False: never pg_upgrade, nor update extensions in, the data being recovered.
    staging = EmbeddedPostgres(data_dir / RESTORE_STAGING, upgrade=False)
    try:
        return _restore_locked(final, staging, target_time=target_time, progress=progress)
    finally:
        staging.stop()
        _keep_log(staging.paths.log_file, final.paths.log_file)
        _remove_staging(staging)
        final.release_lock()


def _restore_locked(
    final: EmbeddedPostgres, staging: EmbeddedPostgres, *, target_time: datetime | None, progress: Progress
) -> RestoreReport:
    import psycopg
    from django.conf import settings

    started = time.monotonic()
    data_dir = final.paths.data_dir
    in_place = data_dir == Path(settings.DATA_DIR).resolve()
    config = target_config()
    target = _target(config)
    backups, unreadable = _readable_metas(target, target.base_labels(), progress)
    meta = _choose_backup(backups, target_time, unreadable)
    _check_server_version(meta)
    wal, newest = _wal_since(target, meta)
    notes: list[str] = []
    stop_at = target_time
    if target_time is not None and (newest is None or newest <= target_time.timestamp()):
        # No transaction after the target can be in the archive: recovery would look for one
        # and fail. Everything archived is the state at that time.
        stop_at = None
        stored = datetime.fromtimestamp(newest, UTC).isoformat() if newest is not None else "never"
        notes.append(
            f"nothing was archived after {target_time.isoformat()} (the newest WAL segment was stored at {stored}): "
            f"restored everything archived, as --to latest does"
        )
        progress(notes[-1])
    _check_wal_complete(wal, meta, stop_at, describe(config))

    pgdata = staging.paths.pgdata
    progress(f"restoring base backup {meta['label']} (finished {meta['finished_at']}) into {final.paths.pgdata}")
    wal_total = sum(1 for n, _ in wal if n[8:] >= meta["start_wal"][8:])
    _remove_staging(staging)  # left by a restore that was killed
    pgdata.mkdir(parents=True)
    _unpack(target, meta, pgdata, progress)
    user = postgres_os_user()
    _chown_tree(pgdata, user)
    source = config
    if config["kind"] == "s3":
        spool = staging.paths.data_dir / "restore-wal"
        source = _prefetch_wal(target, meta, spool, progress)
        _chown_tree(spool, user)
    if user:  # restore_command runs as the server's OS user: let it reach the segments
        _grant_traversal(Path(source["path"]) / "wal" / "-")
    restore_config = _write_config(staging.paths.data_dir, source, user, name="wal-restore.json")
    _check_runs_as(user, restore_config)

    # Recovery settings only for this run (-c): nothing is left in postgresql.conf. Archiving
    # is off: a restore that fails must leave nothing in the archive. An in-place restore
    # stores the new timeline's history file itself once it succeeded (below), so that a later
    # restore picks a timeline of its own.
    staging.server_settings = {
        "archive_mode": "off",
        "restore_command": _command("fetch", restore_config),
        "recovery_target_action": "promote",
    }
    if stop_at is not None:
        staging.server_settings["recovery_target_time"] = stop_at.isoformat()
    log_file = staging.paths.log_file

    def failed(fallback: str) -> BackupError:
        return _recovery_failed(log_file, 0, fallback, stop_at, final.paths.log_file)

    progress(f"replaying WAL from {config['kind']} archive ({wal_total} segments after the backup)")
    try:
        staging.start(timeout=600)
        _wait_recovered(staging, wal_total, progress, failed)
        end = _recovery_end(staging)
    except BackupError:
        raise
    except RuntimeError as exc:
        raise failed(str(exc)) from None
    except psycopg.Error as exc:
        # The server died under our poll (a failed recovery exits): its log says why.
        raise failed(type(exc).__name__) from None
    finally:
        staging.stop()
    if stop_at is None:
        _check_replayed_all(wal, end, describe(config))
    point = end.replayed_at
    segments_replayed = _restored_segments(log_file, 0)

    since = (point or datetime.fromisoformat(meta["started_at"])) - REAPPLY_MARGIN
    # The records go into the marker now, from the target this restore read: a copy
    # (--target-dir) serves with a backup target of its own, where they are not.
    records = erasure_records(after=since, progress=progress)
    if in_place and settings.BACKUP_ENABLED:  # as the server's own archiving would have
        history = f"{end.new_timeline:08X}.history"
        try:
            walarchive.push(config, pgdata / "pg_wal" / history, history)
        except Exception as exc:
            raise BackupError(
                f"cannot store the new timeline's {history} in the archive ({type(exc).__name__}); nothing was restored"
            ) from None
    # Before the data is in place: its first start re-applies the erasures after its recovery
    # point (the ledger's rows in the database tell exactly which) before serving.
    marker = {
        "backup": meta["label"],
        "backup_started_at": meta["started_at"],
        "recovery_point": point.isoformat() if point else None,
        "in_place": in_place,
        "records": records,
    }
    _write_durably(data_dir / REAPPLY_MARKER, marker)
    if final.paths.pgdata.exists():
        final.paths.pgdata.rmdir()  # empty: checked before, and this process holds the lock
    pgdata.rename(final.paths.pgdata)
    _fsync_path(data_dir)

    report = RestoreReport(
        backup=meta["label"],
        data_dir=data_dir,
        target=target_time.isoformat() if target_time else "latest",
        recovery_point=point,
        segments_replayed=segments_replayed,
        elapsed_s=time.monotonic() - started,
        notes=notes,
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


def _wal_since(target, meta: dict) -> tuple[list[tuple[str, float]], float | None]:
    """The archived segments from the backup's first one on, sorted (all that recovery, the gap
    check and the end check need: segments before it never count), and when the newest
    segment of all was stored (None: no segment)."""
    start = meta["start_wal"][8:24]
    wal, newest = [], None
    for name, stored in _wal_segments(target):
        newest = stored if newest is None else max(newest, stored)
        if name[8:24] >= start:
            wal.append((name, stored))
    wal.sort()
    return wal, newest


def _restored_segments(log_file: Path, since: int) -> int:
    with open(log_file, "rb") as fh:
        fh.seek(since)
        return len(re.findall(rb'restored log file "[0-9A-F]{24}" from archive', fh.read()))


def _wait_recovered(
    server: EmbeddedPostgres, wal_total: int, progress: Progress, failed: Callable[[str], BackupError]
) -> None:
    """Until recovery ended and the server promoted; `failed` explains a server that exited."""
    import psycopg

    last_said = ""
    unreachable_since: float | None = None
    while True:
        if server.process is not None and server.process.poll() is not None:
            raise failed(f"the server exited with {server.process.returncode}")
        try:
            with psycopg.connect(server.conninfo("postgres"), autocommit=True, connect_timeout=5) as conn:
                row = conn.execute("SELECT pg_is_in_recovery(), pg_last_xact_replay_timestamp()").fetchone()
        except psycopg.OperationalError:
            # A server going down after a FATAL refuses connections before it exits.
            unreachable_since = unreachable_since or time.monotonic()
            if time.monotonic() - unreachable_since > 60:
                raise
            time.sleep(0.2)
            continue
        unreachable_since = None
        assert row is not None
        in_recovery, replayed_at = row
        if not in_recovery:
            return
        done = _restored_segments(server.paths.log_file, 0)
        at = replayed_at.isoformat() if replayed_at else "-"
        said = f"replayed {done} WAL segments (~{wal_total} archived), last transaction at {at}"
        if said != last_said:
            progress(said)
            last_said = said
        time.sleep(0.5)
