"""Backups and point-in-time recovery against real embedded Postgres servers of their own
(archive_command running as the server's OS user), to a directory and to moto's S3 with object
lock; and the disaster drill end to end (bin/dr-drill)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from io import StringIO
from pathlib import Path

import psycopg
import pytest
from django.core.management import CommandError, call_command

from memsite import walarchive
from memsite.backup import BackupError, backup_base, backup_base_if_due, backups_list, restore, server_settings
from memsite.embedded_pg import EmbeddedPostgres
from tests.conftest import free_port, internal_call
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
    deadline = time.monotonic() + 120  # a bound, not a speed: a loaded CI machine took over 30 s
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
    # Erasure ledger records older than every kept backup go with them; later ones stay.
    ledger = workdir / "backups" / "erasures"
    ledger.mkdir()
    recent = f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%fZ')}-recent.json"
    for name in ("20000101T000000000000Z-old.json", recent):
        (ledger / name).write_text("{}")
    backup_settings.BACKUP_BASE_INTERVAL_H = 0.000001
    labels = [scheduled(), backup_base_if_due()["label"]]
    assert [b["label"] for b in backups_list()] == labels
    assert [p.name for p in ledger.iterdir()] == [recent]
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


def _use_bucket(settings, endpoint: str, bucket: str):
    """A new object-locked bucket on the local S3 server as the backup target; its client."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, **CREDENTIALS)
    client.create_bucket(Bucket=bucket, ObjectLockEnabledForBucket=True)
    settings.BACKUP_S3_BUCKET = bucket
    settings.BACKUP_S3_ENDPOINT_URL = endpoint
    settings.BACKUP_S3_ACCESS_KEY_ID = "testing"
    settings.BACKUP_S3_SECRET_ACCESS_KEY = "testing"
    settings.BACKUP_S3_REGION = "us-east-1"
    settings.BACKUP_S3_PREFIX = "pg"
    settings.BACKUP_OBJECT_LOCK_MODE = "COMPLIANCE"
    settings.BACKUP_OBJECT_LOCK_DAYS = 7
    return client


def test_point_in_time_restore_from_s3_with_object_lock(backup_settings, servers, workdir, s3_server):
    client = _use_bucket(backup_settings, s3_server, "memsite-backups")

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


# --- the erasure ledger: erasures survive a restore to a point before them ----------------------
MEMORIES = {
    "alice": ["Alice's safe code is 8642", "Alice sees Dr. Okafor on Tuesdays"],
    "bob": ["Bob's safe code is 1357", "Bob keeps bees in Nesodden"],
    "carol": ["Carol's safe code is 9753"],
}
_SEED = """
from django.contrib.auth import get_user_model
from core.scope import CallContext, MemoryScope
from memories.services import memory_remember
for name, texts in MEMORIES.items():
    user = get_user_model().objects.create_user(name, name + "@example.com", name + "-password-1")
    for text in texts:
        memory_remember(MemoryScope.for_user(user), memory=text, call=CallContext(channel="internal"))
result = {}
"""
_REMEMBER = """
from django.contrib.auth import get_user_model
from core.scope import CallContext, MemoryScope
from memories.services import memory_remember
user = get_user_model().objects.get(username=NAME)
memory_remember(MemoryScope.for_user(user), memory=TEXT, call=CallContext(channel="internal"))
result = {}
"""
# The erasure as wipe_user_data runs it (in a request, whose id its call takes), then what
# the on-commit task (or beat's sweep) does.
_WIPE = """
from django.contrib.auth import get_user_model
from core.request_ids import request_id_bound, request_id_claim
from core.scope import CallContext, MemoryScope
from memories.toolkit.services import toolkit_user_data_wipe
from memsite.models import ErasureLedger
from memsite.services import erasure_ledger_sweep
user = get_user_model().objects.get(username=NAME)
with request_id_bound():
    call = CallContext(channel="internal", request_id=request_id_claim())
    toolkit_user_data_wipe(MemoryScope.for_user(user), confirm=True, call=call)
result = {"written": erasure_ledger_sweep(), "id": str(ErasureLedger.objects.get(user_pk=user.pk).id)}
"""
_STATE = """
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection
from audit.models import AuditEvent, MemoryHistory, SubjectKey
from core.scope import MemoryScope
result = {}
for user in get_user_model().objects.order_by("username"):
    scope = MemoryScope.for_user(user)
    with connection.cursor() as cursor:
        table = settings.MEMORY_COLLECTION
        cursor.execute(f"SELECT payload->>'data' FROM {table} WHERE payload->>'user_id' = %s", [scope.engine_user_id])
        texts = sorted(row[0] for row in cursor.fetchall())
    reapplied = AuditEvent.objects.filter(subject_user_id=user.pk, operation="erasure_reapply")
    result[user.username] = {
        "memories": texts,
        "history": MemoryHistory.objects.filter(engine_user_id=scope.engine_user_id).count(),
        "key": SubjectKey.objects.filter(subject_user_id=user.pk).exists(),
        "reapplied": [[e.actor_username, e.outcome, e.request_id] for e in reapplied],
    }
"""
_AGAIN = """
from memsite import backup
from memsite.services import erasures_reapply
report = erasures_reapply(entries=backup.erasure_records(), after=None)
result = {"reapplied": report.reapplied, "already": report.already_in_data}
"""


@pytest.fixture
def memsite_env(backup_settings, monkeypatch):
    """manage.py in subprocesses on the test's own data dir and backup target (the launcher's
    children inherit this environment too)."""
    for name in ("DATABASE_URL", "DATABASE_NAME", "CELERY_BROKER_URL", "BACKUP_S3_BUCKET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MEMSITE_DATA_DIR", str(backup_settings.DATA_DIR))
    monkeypatch.setenv("BACKUP_DIR", str(backup_settings.BACKUP_DIR))
    monkeypatch.setenv("BACKUP_ENABLED", "true")
    monkeypatch.setenv("BACKUP_ARCHIVE_TIMEOUT_S", "60")
    return backup_settings


def _manage(*args: str) -> str:
    result = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"manage.py {args[0]}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def _shell(script: str, **values) -> dict:
    prelude = "".join(f"{name} = {json.dumps(value)}\n" for name, value in values.items())
    code = prelude + script + '\nimport json\nprint("RESULT " + json.dumps(result))\n'
    out = _manage("shell", "-c", code)
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def test_a_restore_to_before_an_erasure_re_applies_it_from_the_ledger(memsite_env, servers, workdir, capfd):
    from memsite.launcher import _erasures_reapply

    settings = memsite_env
    primary = servers.start(settings.DATA_DIR, server_settings(settings.DATA_DIR))
    _manage("migrate", "--noinput")
    _shell(_SEED, MEMORIES=MEMORIES)
    backup_base()

    # Carol is erased and comes back before the restore point: both are in the restored data.
    carol_erasure = _shell(_WIPE, NAME="carol")
    _shell(_REMEMBER, NAME="carol", TEXT="Carol is back and likes kayaks")
    time.sleep(0.05)
    cut = datetime.now(UTC)
    time.sleep(0.05)
    alice_erasure = _shell(_WIPE, NAME="alice")
    assert carol_erasure["written"] == alice_erasure["written"] == 1
    _archive_current_segment(primary)

    # The ledger is on the backup target: ids and times only, no name, no content.
    records = sorted((settings.BACKUP_DIR / "erasures").glob("*.json"))
    assert [p.name.split("-", 1)[1] for p in records] == [f"{carol_erasure['id']}.json", f"{alice_erasure['id']}.json"]
    alice_record = json.loads(records[1].read_text())
    assert set(alice_record) == {"id", "user_pk", "engine_user_id", "erased_at", "request_id", "account_deleted"}
    assert alice_record["account_deleted"] is False  # her erasure kept the account
    assert alice_record["request_id"]
    for text in ("alice", "Alice", "8642", "Okafor", "example.com"):
        assert text not in records[1].read_text()

    # Disaster, then a restore in place to before alice's erasure.
    servers.stop(primary)
    shutil.rmtree(settings.DATA_DIR / "postgres")
    said = _manage("restore", "--to", cut.isoformat())
    assert "2 erasure(s) in the ledger around or after the recovery point" in said
    assert (settings.DATA_DIR / "erasures-reapply.json").exists()

    # The first start (the launcher, after migrating) re-applies what the restore brought back.
    capfd.readouterr()
    _erasures_reapply(settings)
    progress = capfd.readouterr().out
    assert f"erasure {alice_erasure['id']}" in progress and "re-applied (2 memories erased)" in progress
    assert f"erasure {carol_erasure['id']}" in progress and "already in the restored data" in progress
    assert not (settings.DATA_DIR / "erasures-reapply.json").exists()

    state = _shell(_STATE)
    assert state["alice"] == {
        "memories": [],
        "history": 0,
        "key": False,
        "reapplied": [["system:restore", "ok", alice_record["request_id"]]],
    }
    assert state["bob"]["memories"] == sorted(MEMORIES["bob"]) and state["bob"]["key"]
    assert state["bob"]["history"] == 2 and state["bob"]["reapplied"] == []
    # Carol's erasure was before the restore point: not done again over what she stored since.
    assert state["carol"]["memories"] == ["Carol is back and likes kayaks"] and state["carol"]["reapplied"] == []

    # Idempotent: the marker is gone, and the ledger's rows say both erasures are in the data.
    assert "no restore left erasures to re-apply here" in _manage("erasures", "--reapply")
    assert _shell(_AGAIN) == {"reapplied": 0, "already": 2}
    assert _shell(_STATE) == state


def _wipe(scope, request_id: str | None = None) -> None:
    from dataclasses import replace

    from memories.toolkit.services import toolkit_user_data_wipe

    call = internal_call() if request_id is None else replace(internal_call(), request_id=request_id)
    toolkit_user_data_wipe(scope, confirm=True, call=call)


@pytest.fixture
def enqueued(monkeypatch) -> list[str]:
    """The ledger writes an erasure enqueues on commit (no broker round trip)."""
    from types import SimpleNamespace

    from memsite import services

    calls: list[str] = []
    monkeypatch.setattr(services, "erasure_ledger_write_task", SimpleNamespace(delay=calls.append))
    return calls


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors")
def test_the_ledger_row_commits_with_the_erasure_and_its_record_holds_no_content(
    backup_settings, alice, alice_scope, bob_scope, enqueued, monkeypatch
):
    from core.request_ids import request_id_bound
    from memories.services import memory_remember
    from memories.toolkit import services as toolkit_services
    from memsite.celery import app
    from memsite.models import ErasureLedger

    memory_remember(alice_scope, memory="Alice's safe code is 8642", call=internal_call())
    memory_remember(bob_scope, memory="Bob's safe code is 1357", call=internal_call())

    def fails(**kwargs):
        raise RuntimeError("the erasure fails after its ledger row was added")

    with monkeypatch.context() as patch:
        patch.setattr(toolkit_services, "subject_content_erase", fails)
        with pytest.raises(RuntimeError):
            _wipe(alice_scope)
    # Rolled back with the erasure: no row, nothing enqueued, nothing erased.
    assert not ErasureLedger.objects.exists() and enqueued == []
    assert toolkit_services.engine_health_counts(alice_scope)["total"] == 1

    with request_id_bound() as bound:
        _wipe(alice_scope, request_id=bound.request_id)
    row = ErasureLedger.objects.get()
    assert (row.state, row.user_pk, row.engine_user_id) == ("pending", alice.pk, alice_scope.engine_user_id)
    assert row.request_id == bound.request_id and enqueued == [str(row.id)]

    assert app.tasks["memsite.erasure_ledger_write"].apply(args=[str(row.id)]).get() is True
    row.refresh_from_db()
    assert row.state == "written" and row.written_at is not None
    (record,) = (backup_settings.BACKUP_DIR / "erasures").iterdir()
    assert record.name == f"{row.erased_at.strftime('%Y%m%dT%H%M%S%fZ')}-{row.id}.json"
    assert json.loads(record.read_text()) == {
        "id": str(row.id),
        "user_pk": alice.pk,
        "engine_user_id": alice_scope.engine_user_id,
        "erased_at": row.erased_at.isoformat(),
        "request_id": bound.request_id,
        "account_deleted": False,
    }
    for text in ("alice", "8642", "safe code", "example.com"):
        assert text not in record.read_text()
    # Written once: the task again (a redelivery) does nothing; the same record again is fine.
    assert app.tasks["memsite.erasure_ledger_write"].apply(args=[str(row.id)]).get() is False
    from memsite import backup

    backup.erasure_record_store(name=record.name, record=json.loads(record.read_text()))
    with pytest.raises(BackupError, match="different content"):
        backup.erasure_record_store(name=record.name, record={"id": "other"})


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors")
def test_a_ledger_write_that_fails_is_retried_and_never_lost(
    backup_settings, alice_scope, bob_scope, enqueued, monkeypatch, caplog
):
    from memsite.backup import _DirTarget
    from memsite.celery import app
    from memsite.models import ErasureLedger
    from memsite.services import erasure_ledger_sweep

    store = _DirTarget.store_erasure
    failures = {"left": 2}

    def flaky(self, name: str, body: bytes) -> None:
        if failures["left"]:
            failures["left"] -= 1
            raise OSError("the backup volume at /mnt/secret-path is gone")
        store(self, name, body)

    monkeypatch.setattr(_DirTarget, "store_erasure", flaky)
    task = app.tasks["memsite.erasure_ledger_write"]

    _wipe(alice_scope)
    row = ErasureLedger.objects.get()
    assert task.apply(args=[str(row.id)], throw=False).successful()  # eager: its retries run at once
    row.refresh_from_db()
    assert (row.state, row.attempts, row.last_error) == ("written", 3, "")

    # Down for longer than the task's retries: the row stays pending for beat's sweep.
    failures["left"] = 1000
    _wipe(bob_scope)
    row = ErasureLedger.objects.get(user_pk=bob_scope.user_pk)
    assert task.apply(args=[str(row.id)], throw=False).failed()
    row.refresh_from_db()
    assert (row.state, row.attempts, row.last_error) == ("pending", 9, "OSError")
    caplog.clear()
    assert erasure_ledger_sweep() == 0
    row.refresh_from_db()
    assert row.state == "pending" and row.attempts == 10
    assert "OSError" in caplog.text and "secret-path" not in caplog.text
    failures["left"] = 0
    assert erasure_ledger_sweep() == 1
    row.refresh_from_db()
    assert row.state == "written"
    assert len(list((backup_settings.BACKUP_DIR / "erasures").glob("*.json"))) == 2
    assert "memsite.erasure_ledger_sweep" in {e["task"] for e in backup_settings.CELERY_BEAT_SCHEDULE.values()}


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors")
@pytest.mark.parametrize("setup", ["external database", "backups off"])
def test_without_memsite_backups_no_ledger_and_the_audit_trail_lists_erasures(
    setup, backup_settings, alice, alice_scope, enqueued
):
    from memsite.models import ErasureLedger

    if setup == "external database":
        backup_settings.EMBEDDED_DATABASE = False
    else:
        backup_settings.BACKUP_ENABLED = False
    before = datetime.now(UTC) - timedelta(seconds=1)
    _wipe(alice_scope)
    assert not ErasureLedger.objects.exists() and enqueued == []

    out = StringIO()
    call_command("erasures", "--since", before.isoformat(), "--json", stdout=out)
    (line,) = out.getvalue().splitlines()
    listed = json.loads(line)
    assert (listed["user_pk"], listed["engine_user_id"]) == (alice.pk, alice_scope.engine_user_id)
    assert "alice" not in line
    # The list, kept by the operator, re-applies after their own restore (here: nothing to
    # erase again, and a second run finds it done).
    listing = Path(tempfile.mkdtemp(prefix="mbk-")) / "erasures.jsonl"
    listing.write_text(line + "\n")
    call_command("erasures", "--reapply-from", str(listing), "--after", before.isoformat(), stdout=out)
    assert "1 re-applied" in out.getvalue()
    call_command("erasures", "--reapply-from", str(listing), "--after", before.isoformat(), stdout=out)
    assert "0 re-applied, 1 already in the data" in out.getvalue()
    shutil.rmtree(listing.parent)


def test_the_erasure_ledger_in_a_bucket_is_under_object_lock(backup_settings, s3_server):
    from memsite import backup

    client = _use_bucket(backup_settings, s3_server, "memsite-ledger")

    now = datetime.now(UTC)
    old = {"id": "a", "user_pk": 1, "engine_user_id": "default:1", "erased_at": (now - timedelta(days=2)).isoformat()}
    new = {"id": "b", "user_pk": 2, "engine_user_id": "default:2", "erased_at": now.isoformat(), "request_id": "r"}
    for record in (old, new):
        name = backup.erasure_record_name(erased_at=datetime.fromisoformat(record["erased_at"]), ledger_id=record["id"])
        backup.erasure_record_store(name=name, record=record)
    assert backup.erasure_records() == [old, new]
    assert backup.erasure_records(after=now - timedelta(days=1)) == [new]
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="memsite-ledger", Prefix="pg/erasures/")["Contents"]]
    assert len(keys) == 2
    for key in keys:
        assert client.head_object(Bucket="memsite-ledger", Key=key)["ObjectLockMode"] == "COMPLIANCE"


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors")
def test_a_restored_copy_re_applies_from_the_records_its_restore_read_not_its_own_target(
    backup_settings, alice, alice_scope, bob, enqueued, workdir
):
    """A copy (`restore --target-dir`) serves with a backup target of its own, where the
    source's ledger is not: the restore puts the records into its marker, and a copy whose
    marker has none refuses to start rather than serve erased data."""
    from memories.toolkit.models import Decision
    from memsite import backup
    from memsite.models import ErasureLedger
    from memsite.services import erasure_ledger_write, erasures_reapply_after_restore

    _wipe(alice_scope)
    row = ErasureLedger.objects.get()
    erasure_ledger_write(ledger_id=str(row.id))
    records = backup.erasure_records()
    # As in the restored data: the erasure's row is not there, and alice has data again.
    ErasureLedger.objects.all().delete()
    Decision.objects.create(
        user_id=alice.pk, key="k", value="v", created_at=datetime.now(UTC), updated_at=datetime.now(UTC)
    )
    Decision.objects.create(
        user_id=bob.pk, key="k", value="v", created_at=datetime.now(UTC), updated_at=datetime.now(UTC)
    )
    backup_settings.BACKUP_DIR = workdir / "copy-backups"  # the copy's own, empty target
    backup_settings.DATA_DIR.mkdir(parents=True, exist_ok=True)
    marker = backup_settings.DATA_DIR / backup.REAPPLY_MARKER
    base = {"backup": "b", "backup_started_at": (row.erased_at - timedelta(hours=1)).isoformat(), "in_place": False}
    marker.write_text(json.dumps({**base, "recovery_point": None}))
    with pytest.raises(BackupError, match="restored as a copy"):
        erasures_reapply_after_restore()
    assert marker.exists() and Decision.objects.filter(user_id=alice.pk).exists()

    marker.write_text(json.dumps({**base, "recovery_point": None, "records": records}))
    report = erasures_reapply_after_restore()
    assert (report.reapplied, report.already_in_data) == (1, 0)
    assert not Decision.objects.filter(user_id=alice.pk).exists() and Decision.objects.filter(user_id=bob.pk).exists()
    assert not marker.exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors")
def test_a_re_apply_never_erases_a_user_who_joined_after_the_erasure_or_applies_half_a_bad_list(
    backup_settings, alice, bob, workdir
):
    """After a restore the id sequence goes back: a new sign-up can get the pk of a user
    erased after the recovery point. And a bad line anywhere stops the list before any
    erasure is applied."""
    import uuid

    from memories.toolkit.models import Decision

    Decision.objects.create(
        user_id=alice.pk, key="k", value="v", created_at=datetime.now(UTC), updated_at=datetime.now(UTC)
    )
    Decision.objects.create(
        user_id=bob.pk, key="k", value="v", created_at=datetime.now(UTC), updated_at=datetime.now(UTC)
    )
    erased_before_bob_joined = {
        "id": str(uuid.uuid4()),
        "user_pk": bob.pk,
        "engine_user_id": f"t:{bob.pk}",
        "erased_at": (bob.date_joined - timedelta(hours=1)).isoformat(),
        "request_id": "",
    }
    of_alice = {**erased_before_bob_joined, "id": str(uuid.uuid4()), "user_pk": alice.pk}
    of_alice["erased_at"] = (alice.date_joined + timedelta(seconds=1)).isoformat()
    listing = workdir / "erasures.jsonl"
    after = (bob.date_joined - timedelta(days=1)).isoformat()
    out = StringIO()
    for bad, problem in [
        ([1, 2], "not a JSON object"),
        ({**of_alice, "id": "not-a-uuid"}, "bad or missing id"),
        ({**of_alice, "user_pk": "abc"}, "bad or missing user_pk"),
        ({**of_alice, "erased_at": "2026-11-26T10:00:00"}, "erased_at has no UTC offset"),
        ({k: v for k, v in of_alice.items() if k != "engine_user_id"}, "bad or missing engine_user_id"),
    ]:
        listing.write_text(json.dumps(of_alice) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(CommandError, match=f"erasure entry 2: {problem}"):
            call_command("erasures", "--reapply-from", str(listing), "--after", after, stdout=out)
        assert Decision.objects.filter(user_id=alice.pk).exists()  # nothing applied

    listing.write_text(json.dumps(erased_before_bob_joined) + "\n")
    call_command("erasures", "--reapply-from", str(listing), "--after", after, stdout=out)
    assert "joined after the erasure" in out.getvalue()
    assert Decision.objects.filter(user_id=bob.pk).exists()


def test_an_unreadable_ledger_record_is_named(backup_settings):
    from memsite import backup

    folder = backup_settings.BACKUP_DIR / "erasures"
    folder.mkdir(parents=True)
    (folder / "20261126T100000000000Z-x.json").write_text("{truncated")
    with pytest.raises(BackupError, match=r"erasures/20261126T100000000000Z-x.json is unreadable \(JSONDecodeError\)"):
        backup.erasure_records()
