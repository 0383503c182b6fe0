"""Backups and point-in-time recovery against real embedded Postgres servers of their own
(archive_command running as the server's OS user), to a directory and to moto's S3 with object
lock; and the disaster drill end to end (bin/dr-drill)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from io import StringIO
from pathlib import Path

import psycopg
import pytest
from django.core.management import CommandError, call_command

from memsite import walarchive
from memsite.backup import BackupError, backup_base, backup_base_if_due, backups_list, restore, server_settings
from memsite.embedded_pg import EmbeddedPostgres
from tests.conftest import free_port
from tests.environment import ROOT

pytestmark = pytest.mark.slow
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


@pytest.fixture
def workdir():
    # Unix socket paths must stay short, so not under pytest's deep tmp_path.
    with tempfile.TemporaryDirectory(prefix="mbk-") as tmp:
        yield Path(tmp)


@pytest.fixture
def backup_settings(settings, workdir):
    settings.DATA_DIR = workdir / "data"
    settings.BACKUP_DIR = workdir / "backups"
    settings.BACKUP_ENABLED = True
    settings.BACKUP_ARCHIVE_TIMEOUT_S = 60
    settings.BACKUP_KEEP = 2
    settings.EMBEDDED_DATABASE = True
    return settings


class Servers:
    """Embedded servers started by a test, all stopped at its end."""

    def __init__(self):
        self.started: list[EmbeddedPostgres] = []

    def start(self, data_dir: Path, settings: dict | None = None) -> EmbeddedPostgres:
        server = EmbeddedPostgres(data_dir, server_settings=settings)
        assert server.try_lock()
        server.start()
        self.started.append(server)
        return server

    def stop(self, server: EmbeddedPostgres) -> None:
        server.stop()
        server.release_lock()
        self.started.remove(server)


@pytest.fixture
def servers():
    registry = Servers()
    yield registry
    for server in list(registry.started):
        registry.stop(server)


def _sql(server: EmbeddedPostgres, query: str, *params):
    with psycopg.connect(server.conninfo(), autocommit=True) as conn:
        cursor = conn.execute(query, params or None)
        return cursor.fetchall() if cursor.description else None


def _archive_current_segment(server: EmbeddedPostgres) -> None:
    """Switch WAL and wait until the archiver has stored the segment (what archive_timeout does)."""
    name = _sql(server, "SELECT pg_walfile_name(pg_switch_wal())")[0][0]
    deadline = time.monotonic() + 30
    while True:
        last, failed = _sql(server, "SELECT last_archived_wal, last_failed_wal FROM pg_stat_archiver")[0]
        if last and last >= name:
            return
        assert time.monotonic() < deadline, f"{name} not archived (last {last}, failed {failed})"
        time.sleep(0.1)


def _fill(server: EmbeddedPostgres, first: int, last: int) -> None:
    _sql(server, "CREATE TABLE IF NOT EXISTS facts (i int PRIMARY KEY, at timestamptz DEFAULT clock_timestamp())")
    _sql(server, "INSERT INTO facts (i) SELECT generate_series(%s::int, %s::int)", first, last)


def _rows(servers: Servers, data_dir: Path) -> list[int]:
    server = servers.start(data_dir)
    try:
        return [r[0] for r in _sql(server, "SELECT i FROM facts ORDER BY i")]
    finally:
        servers.stop(server)


def _pitr_round_trip(settings, servers: Servers, workdir: Path) -> list[str]:
    primary = servers.start(settings.DATA_DIR, server_settings(settings.DATA_DIR))
    _fill(primary, 1, 100)
    said: list[str] = []
    meta = backup_base(progress=said.append)
    assert any(line.startswith("done: ") for line in said)
    assert [b["label"] for b in backups_list()] == [meta["label"]]

    _fill(primary, 101, 200)
    time.sleep(0.05)
    cut = datetime.now(UTC)
    time.sleep(0.05)
    _fill(primary, 201, 300)
    _archive_current_segment(primary)

    said.clear()
    report = restore(target_time=cut, data_dir=workdir / "pitr", progress=said.append)
    assert report.backup == meta["label"] and report.recovery_point <= cut
    assert any("replayed" in line for line in said)
    assert _rows(servers, workdir / "pitr") == list(range(1, 201))
    restore_output = list(said)

    report = restore(target_time=None, data_dir=workdir / "latest")
    assert _rows(servers, workdir / "latest") == list(range(1, 301))

    # Never over an existing data dir; never before the first backup finished.
    with pytest.raises(BackupError, match="not empty"):
        restore(target_time=None, data_dir=workdir / "latest")
    with pytest.raises(BackupError, match="no base backup finished before"):
        restore(target_time=datetime(2000, 1, 1, tzinfo=UTC), data_dir=workdir / "early")
    return restore_output


def test_point_in_time_restore_from_a_directory(backup_settings, servers, workdir):
    _pitr_round_trip(backup_settings, servers, workdir)
    wal = sorted(p.name for p in (workdir / "backups" / "wal").iterdir())
    assert wal and all(name.endswith(".gz") for name in wal)
    # A fresh backup when due (beat's task), none when recent; retention keeps BACKUP_KEEP of them.
    from memsite.tasks import backup_base_if_due as scheduled

    assert scheduled() is None
    backup_settings.BACKUP_BASE_INTERVAL_H = 0.000001
    labels = [scheduled(), backup_base_if_due()["label"]]
    assert [b["label"] for b in backups_list()] == labels
    oldest = backups_list()[0]["start_wal"]
    kept = [p.name.removesuffix(".gz") for p in (workdir / "backups" / "wal").glob("*.gz")]
    assert kept and all(name[8:24] >= oldest[8:24] for name in kept if not name.endswith(".history"))
    # The WAL from before the newest backups is pruned (counts are no test: the new backups
    # themselves switch and archive segments).
    assert {name.removesuffix(".gz") for name in wal} - set(kept)
    # A backup killed while writing is never offered for restore.
    (workdir / "backups" / "base" / ".partial-x").mkdir()
    (workdir / "backups" / "base" / ".partial-x" / "backup.json").write_text("{}")
    assert [b["label"] for b in backups_list()] == labels


def test_restore_command_refuses_bad_input_and_a_running_instance(backup_settings, servers):
    with pytest.raises(CommandError, match="ISO 8601"):
        call_command("restore", "--to", "yesterday")
    with pytest.raises(CommandError, match="no complete base backup"):
        call_command("restore", "--to", "latest", "--target-dir", str(backup_settings.DATA_DIR.parent / "x"))
    servers.start(backup_settings.DATA_DIR, server_settings(backup_settings.DATA_DIR))
    out = StringIO()
    call_command("backup", stdout=out)
    assert "done: " in out.getvalue()
    call_command("backup", "--list", stdout=out)
    assert "WAL archive: " in out.getvalue()
    with pytest.raises(CommandError, match="not empty"):
        call_command("restore", "--to", "latest")  # in place, while the server runs there


def test_external_database_is_not_backed_up_by_memsite(backup_settings):
    backup_settings.EMBEDDED_DATABASE = False
    with pytest.raises(BackupError, match="DATABASE_URL"):
        backup_base()


def _push(config_path: Path, source: Path, name: str) -> subprocess.CompletedProcess:
    script = Path(walarchive.__file__)
    return subprocess.run(
        [sys.executable, str(script), "push", str(config_path), str(source), name], capture_output=True, text=True
    )


def test_archive_command_stores_durably_and_never_overwrites(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"kind": "dir", "path": str(tmp_path / "archive")}))
    segment = tmp_path / "000000010000000000000001"
    segment.write_bytes(b"wal" * 1000)

    assert _push(config, segment, segment.name).returncode == 0
    stored = tmp_path / "archive" / "wal" / f"{segment.name}.gz"
    assert stored.exists()
    assert _push(config, segment, segment.name).returncode == 0  # the same segment again: fine

    segment.write_bytes(b"other" * 1000)
    result = _push(config, segment, segment.name)
    assert result.returncode == 1 and "different content" in result.stderr
    assert walarchive.fetch(json.loads(config.read_text()), segment.name, tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == b"wal" * 1000
    assert not walarchive.fetch(json.loads(config.read_text()), "000000010000000000000009", tmp_path / "none")

    # A target it cannot write to is a failure, never a success.
    config.write_text(json.dumps({"kind": "dir", "path": str(segment)}))
    assert _push(config, segment, "000000010000000000000002").returncode == 1
    assert not list(tmp_path.glob("**/*.tmp"))


@pytest.fixture(scope="module")
def s3_server():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def test_point_in_time_restore_from_s3_with_object_lock(backup_settings, servers, workdir, s3_server):
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server, **CREDENTIALS)
    client.create_bucket(Bucket="memsite-backups", ObjectLockEnabledForBucket=True)
    backup_settings.BACKUP_S3_BUCKET = "memsite-backups"
    backup_settings.BACKUP_S3_ENDPOINT_URL = s3_server
    backup_settings.BACKUP_S3_ACCESS_KEY_ID = "testing"
    backup_settings.BACKUP_S3_SECRET_ACCESS_KEY = "testing"
    backup_settings.BACKUP_S3_REGION = "us-east-1"
    backup_settings.BACKUP_S3_PREFIX = "pg"
    backup_settings.BACKUP_OBJECT_LOCK_MODE = "COMPLIANCE"
    backup_settings.BACKUP_OBJECT_LOCK_DAYS = 7

    said = _pitr_round_trip(backup_settings, servers, workdir)
    assert any(line.startswith("downloading ") for line in said)  # WAL fetched up front, not per segment
    assert not (workdir / "pitr" / "restore-wal").exists()

    keys = [o["Key"] for o in client.list_objects_v2(Bucket="memsite-backups")["Contents"]]
    assert any(k.startswith("pg/wal/") for k in keys) and any(k.endswith("/backup.json") for k in keys)
    assert not (workdir / "backups").exists()
    for key in keys:
        assert client.head_object(Bucket="memsite-backups", Key=key)["ObjectLockMode"] == "COMPLIANCE"
    # The config handed to Postgres holds the keys: only its OS user may read it.
    assert (backup_settings.DATA_DIR / "wal-archive.json").stat().st_mode & 0o077 == 0


def test_disaster_drill(tmp_path):
    """bin/dr-drill: no acknowledged write before the recovery point is lost; RTO/RPO printed."""
    figures = tmp_path / "drill.json"
    result = subprocess.run(
        [sys.executable, "-m", "memsite.drill", "--load", "20", "--write-seconds", "15", "--archive-timeout", "5",
         "--json", str(figures)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "RTO " in result.stdout and "RPO " in result.stdout
    drill = json.loads(figures.read_text())
    assert drill["lost_before_recovery_point"] == 0
    assert drill["acknowledged_before_recovery_point"] > 20  # the load and part of the live phase
    assert drill["rpo_s"] < 60
