"""Restores that cannot be done whole refuse with a message an operator can act on, leave
nothing behind and can simply be run again (review 19): a damaged or missing WAL segment, a
target time with nothing after it, a corrupt base file, a backup of another PostgreSQL major,
a damaged backup.json. Real embedded Postgres servers, one archive shared by the module (each
test damages a copy of it)."""

from __future__ import annotations

import gzip
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from io import StringIO
from pathlib import Path

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from memsite import backup, walarchive
from memsite.backup import BackupError, backup_base, backups_list, restore, server_settings
from memsite.embedded_pg import EmbeddedPostgres, postgres_os_user
from tests.conftest import free_port

pytestmark = pytest.mark.slow
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


def _sql(server: EmbeddedPostgres, query: str, *params):
    with psycopg.connect(server.conninfo(), autocommit=True) as conn:
        cursor = conn.execute(query, params or None)
        return cursor.fetchall() if cursor.description else None


def _switch_and_archive(server: EmbeddedPostgres) -> str:
    """The current segment switched and archived (what archive_timeout does); its name."""
    name = _sql(server, "SELECT pg_walfile_name(pg_switch_wal())")[0][0]
    deadline = time.monotonic() + 120  # a bound, not a speed (as in test_backup.py)
    while (_sql(server, "SELECT last_archived_wal FROM pg_stat_archiver")[0][0] or "") < name:
        assert time.monotonic() < deadline, f"{name} not archived"
        time.sleep(0.1)
    return name


def _fill(server: EmbeddedPostgres, first: int, last: int) -> None:
    _sql(server, "CREATE TABLE IF NOT EXISTS facts (i int PRIMARY KEY)")
    _sql(server, "INSERT INTO facts (i) SELECT generate_series(%s::int, %s::int)", first, last)


@dataclass
class Archive:
    backups: Path
    labels: list[str]  # two base backups, oldest first
    segments: list[str]  # archived after the newest backup: rows 201-300, 301-400, 401-500, then none
    last_commit: datetime  # before the last segment, which holds no transaction


@pytest.fixture(scope="module")
def archive():
    with tempfile.TemporaryDirectory(prefix="mbr-") as tmp:
        root = Path(tmp)
        with override_settings(
            DATA_DIR=root / "data",
            BACKUP_DIR=root / "backups",
            BACKUP_ENABLED=True,
            BACKUP_KEEP=5,
            EMBEDDED_DATABASE=True,
        ):
            # autovacuum off: no transaction of its own lands in the last segment.
            primary = EmbeddedPostgres(root / "data", {**server_settings(root / "data"), "autovacuum": "off"})
            assert primary.try_lock()
            primary.start()
            try:
                _fill(primary, 1, 100)
                labels = [backup_base()["label"]]
                _fill(primary, 101, 200)
                labels.append(backup_base()["label"])
                segments = []
                for first in (201, 301, 401):
                    _fill(primary, first, first + 99)
                    segments.append(_switch_and_archive(primary))
                last_commit = datetime.now(UTC)
                time.sleep(0.2)
                _sql(primary, "CHECKPOINT")
                segments.append(_switch_and_archive(primary))
            finally:
                primary.stop()
                primary.release_lock()
        yield Archive(root / "backups", labels, segments, last_commit)


@pytest.fixture
def workdir():
    # Unix socket paths must stay short, so not under pytest's deep tmp_path.
    with tempfile.TemporaryDirectory(prefix="mbr-") as tmp:
        yield Path(tmp)


@pytest.fixture
def copy(settings, archive, workdir) -> Path:
    """A copy of the module's backups (mtimes kept) as this test's target; a fresh data dir."""
    shutil.copytree(archive.backups, workdir / "backups")
    user = postgres_os_user()
    if user:  # as the archive command left them: the server's OS user reads them at restore
        for path in (workdir / "backups", *(workdir / "backups").rglob("*")):
            shutil.chown(path, user, user)
    settings.DATA_DIR = workdir / "data"
    settings.BACKUP_DIR = workdir / "backups"
    settings.BACKUP_ENABLED = True
    settings.BACKUP_KEEP = 5
    settings.BACKUP_BASE_INTERVAL_H = 1000
    settings.EMBEDDED_DATABASE = True
    return workdir / "backups"


def _rows(data_dir: Path) -> list[int]:
    server = EmbeddedPostgres(data_dir)
    assert server.try_lock()
    server.start()
    try:
        return [r[0] for r in _sql(server, "SELECT i FROM facts ORDER BY i")]
    finally:
        server.stop()
        server.release_lock()


def _left_behind(data_dir: Path) -> list[str]:
    """What a failed restore left that matters: restored data, its staging, an erasure marker."""
    found = [p.name for p in data_dir.iterdir() if p.name in (backup.RESTORE_STAGING, backup.REAPPLY_MARKER)]
    pgdata = data_dir / "postgres"
    if pgdata.exists() and any(pgdata.iterdir()):
        found.append("postgres")
    return found


def _segment(copy: Path, name: str) -> Path:
    return copy / "wal" / f"{name}.gz"


# -- 1. a damaged or missing WAL segment -----------------------------------------------------------
def _fetch(config: Path, name: str, dest: Path) -> int:
    script = Path(walarchive.__file__)
    return subprocess.run([sys.executable, str(script), "fetch", str(config), name, str(dest)]).returncode


def test_restore_command_says_not_found_only_for_a_file_that_is_not_there(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"kind": "dir", "path": str(tmp_path)}))
    (tmp_path / "wal").mkdir()
    good = gzip.compress(b"wal" * 1000)
    (tmp_path / "wal" / "000000010000000000000001.gz").write_bytes(good)
    (tmp_path / "wal" / "000000010000000000000002.gz").write_bytes(good[: len(good) // 2])
    (tmp_path / "wal" / "000000010000000000000003.gz").write_bytes(b"not gzip at all")
    (tmp_path / "wal" / "000000010000000000000004.gz").write_bytes(gzip.compress(b""))

    assert _fetch(config, "000000010000000000000001", tmp_path / "out") == 0
    assert (tmp_path / "out").read_bytes() == b"wal" * 1000
    assert _fetch(config, "000000010000000000000009", tmp_path / "out") == 1  # not archived: the WAL ends here
    assert _fetch(config, "00000002.history", tmp_path / "out") == 1
    # Anything else must abort recovery (> 125), never read as "the WAL ends here".
    for damaged in ("000000010000000000000002", "000000010000000000000003", "000000010000000000000004"):
        assert _fetch(config, damaged, tmp_path / "out") == walarchive.FETCH_FAILED > 125
    assert _fetch(tmp_path / "no-config.json", "000000010000000000000001", tmp_path / "out") > 125


def test_a_damaged_segment_fails_the_restore_and_leaves_nothing_applied(archive, copy, workdir):
    """In place: not even the archive gets a new timeline from the failed run."""
    damaged = _segment(copy, archive.segments[1])
    good = damaged.read_bytes()
    damaged.write_bytes(good[: len(good) // 3])

    failure = rf'could not restore file "{archive.segments[1]}".*\(EOFError: .*\).*good copy'
    with pytest.raises(BackupError, match=failure):
        restore(target_time=None)
    assert _left_behind(workdir / "data") == []
    assert not list((copy / "wal").glob("*.history.gz"))

    damaged.write_bytes(good)
    report = restore(target_time=None)  # the same data dir again: nothing to move away
    assert report.segments_replayed >= 4
    assert _rows(workdir / "data") == list(range(1, 501))
    assert (copy / "wal" / "00000002.history.gz").exists()  # archived once the restore succeeded
    assert (workdir / "data" / backup.REAPPLY_MARKER).exists()


def test_a_missing_segment_is_named_before_anything_is_unpacked(archive, copy, workdir):
    _segment(copy, archive.segments[1]).unlink()
    with pytest.raises(CommandError, match=rf"WAL archive has a gap: 1 segment\(s\) missing .*{archive.segments[1]}"):
        call_command("restore", "--to", "latest", "--target-dir", str(workdir / "x"), stdout=StringIO())
    assert _left_behind(workdir / "x") == []


def test_a_segment_that_is_not_wal_is_found_after_replay_and_nothing_is_restored(archive, copy, workdir):
    # Well-formed gzip of the right size: Postgres takes the invalid page for the end of the WAL.
    _segment(copy, archive.segments[1]).write_bytes(gzip.compress(bytes(16 * 1024 * 1024)))
    stopped = rf"holds segments up to {archive.segments[-1]}: {archive.segments[1]} is damaged or missing"
    with pytest.raises(BackupError, match=stopped):
        restore(target_time=None, data_dir=workdir / "x")
    assert _left_behind(workdir / "x") == []


# -- 2. a target time with nothing after it --------------------------------------------------------
def test_a_time_after_the_newest_archived_wal_restores_everything_with_a_note(copy, workdir):
    out = StringIO()
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    call_command("restore", "--to", later, "--target-dir", str(workdir / "x"), stdout=out)
    assert f"nothing was archived after {later}" in out.getvalue()
    assert _rows(workdir / "x") == list(range(1, 501))


def test_a_time_with_no_transaction_after_it_says_use_latest_and_cleans_up(archive, copy, workdir):
    after_last_commit = archive.last_commit + timedelta(milliseconds=50)
    with pytest.raises(CommandError, match=r"holds no transaction after .* restore --to latest for everything"):
        call_command("restore", "--to", after_last_commit.isoformat(), "--target-dir", str(workdir / "x"))
    assert _left_behind(workdir / "x") == []
    call_command("restore", "--to", "latest", "--target-dir", str(workdir / "x"), stdout=StringIO())
    assert _rows(workdir / "x") == list(range(1, 501))


# -- 3. a corrupt base backup file -----------------------------------------------------------------
def test_every_base_file_is_checked_before_any_is_unpacked(archive, copy, workdir):
    wal_tar = copy / "base" / archive.labels[-1] / "pg_wal.tar.gz"
    wal_tar.write_bytes(wal_tar.read_bytes()[:-10])  # base.tar.gz, unpacked first, is intact
    with pytest.raises(BackupError, match=f"pg_wal.tar.gz of backup {archive.labels[-1]} is corrupt"):
        restore(target_time=None, data_dir=workdir / "x")
    assert _left_behind(workdir / "x") == []


# -- 4. a backup of another PostgreSQL major -------------------------------------------------------
def test_a_backup_of_another_major_version_is_refused_up_front(archive, copy, workdir):
    meta_file = copy / "base" / archive.labels[-1] / "backup.json"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "server_version": "16.2"}))
    with pytest.raises(CommandError, match=r"taken by PostgreSQL 16\.2 and this memsite runs PostgreSQL 18"):
        call_command("restore", "--to", "latest", "--target-dir", str(workdir / "x"))
    assert _left_behind(workdir / "x") == []


def test_a_server_that_failed_without_a_log_is_explained_by_its_error(tmp_path):
    error = backup._recovery_failed(tmp_path / "none.log", 0, "embedded postgres exited with 1", None, tmp_path)
    assert str(error).startswith("recovery failed: embedded postgres exited with 1")


# -- 5. a damaged backup.json ----------------------------------------------------------------------
def test_a_client_refused_during_the_failed_recovery_does_not_hide_its_cause(tmp_path):
    """Seen in CI: our progress poll was refused after the restore_command failed, and that FATAL came last."""
    log = tmp_path / "postgres.log"
    log.write_text(
        "LOG:  walarchive ['fetch'] failed: EOFError: Compressed file ended\n"
        'FATAL:  could not restore file "000000010000000000000006" from archive: '
        "child process exited with exit code 200\n"
        "LOG:  startup process (PID 25490) exited with exit code 1\n"
        "FATAL:  the database system is in recovery mode\n"
        "LOG:  database system is shut down\n"
    )
    error = backup._recovery_failed(log, 0, "OperationalError", None, tmp_path / "kept.log")
    assert 'could not restore file "000000010000000000000006"' in str(error)
    assert "(EOFError: Compressed file ended)" in str(error)
    assert "recovery mode" not in str(error)


def test_a_damaged_backup_json_skips_that_backup_and_keeps_the_others_usable(archive, copy, workdir, caplog):
    from memsite.tasks import backup_base_if_due as scheduled

    newest = copy / "base" / archive.labels[-1] / "backup.json"
    newest.write_text(newest.read_text()[:40])
    with caplog.at_level(logging.WARNING, logger="memsite.backup"):
        assert [b["label"] for b in backups_list()] == archive.labels[:1]
    assert f"base backup {archive.labels[-1]}: backup.json is unreadable (JSONDecodeError)" in caplog.text
    out = StringIO()
    call_command("backup", "--list", stdout=out)
    listed = out.getvalue().splitlines()
    assert any(line.startswith(archive.labels[0]) for line in listed)
    # The damaged one is not listed as a backup, only named as skipped.
    assert [line for line in listed if archive.labels[-1] in line] == [
        f"skipped: base backup {archive.labels[-1]}: backup.json is unreadable (JSONDecodeError)"
    ]
    call_command("backup", "--if-due", stdout=out)
    assert scheduled() is None  # beat's task: the readable backup is recent
    # Retention counts readable backups only: the good one is never removed for a broken one.
    backup._apply_retention(backup._target(), 1, lambda _: None)
    assert (copy / "base" / archive.labels[0] / "backup.json").exists()

    said: list[str] = []
    report = restore(target_time=None, data_dir=workdir / "x", progress=said.append)
    assert report.backup == archive.labels[0]
    assert any(f"{archive.labels[-1]}: backup.json is unreadable" in line for line in said)
    assert _rows(workdir / "x") == list(range(1, 501))  # the older backup plus all the WAL

    oldest = copy / "base" / archive.labels[0] / "backup.json"
    oldest.write_text(json.dumps({"label": archive.labels[0]}))
    unreadable = rf"no complete base backup .*{archive.labels[0]}: backup.json is unreadable"
    with pytest.raises(CommandError, match=unreadable):
        call_command("restore", "--to", "latest", "--target-dir", str(workdir / "y"))
    assert _left_behind(workdir / "y") == []


def test_a_damaged_backup_json_in_a_bucket_is_skipped_and_named(settings, workdir):
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, **CREDENTIALS)
        client.create_bucket(Bucket="memsite-broken")
        client.put_object(Bucket="memsite-broken", Key="pg/base/20260101T000000000000Z/backup.json", Body=b'{"lab')
        settings.DATA_DIR = workdir / "data"
        settings.EMBEDDED_DATABASE = True
        settings.BACKUP_S3_BUCKET = "memsite-broken"
        settings.BACKUP_S3_ENDPOINT_URL = endpoint
        settings.BACKUP_S3_ACCESS_KEY_ID = "testing"
        settings.BACKUP_S3_SECRET_ACCESS_KEY = "testing"
        settings.BACKUP_S3_REGION = "us-east-1"
        settings.BACKUP_S3_PREFIX = "pg"
        assert backups_list() == []
        assert backup.archive_status().unreadable == [
            "base backup 20260101T000000000000Z: backup.json is unreadable (JSONDecodeError)"
        ]
        with pytest.raises(BackupError, match="20260101T000000000000Z: backup.json is unreadable"):
            restore(target_time=None, data_dir=workdir / "x")
    finally:
        server.stop()
