"""An embedded data dir created by the previous default (pgserver 0.1.4: PostgreSQL 16.2,
pgvector 0.6.2) is upgraded on first start by the current binaries, losing nothing.

The old data dir is filled through the real service (REST `remember` with API keys, so audit
rows, usage events and history rows are written by the product code), a snapshot of every
row is taken, the old postmaster is killed (an unclean stop, the harder case), and the new
binaries start on it: rows are identical, search finds every memory, pgvector is >= 0.8.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from memsite.embedded_pg import EmbeddedPostgres, _package_bin_dir
from tests.environment import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(os.environ.get("DATABASE_URL")), reason="embedded Postgres only"),
]

FACTS = {
    "alice": [
        "Alice's sister lives in Lisbon and teaches chemistry.",
        "Alice is allergic to peanuts.",
        "Alice prefers window seats on long flights.",
        "Alice's cat is called Miso.",
    ],
    "bob": [
        "Bob runs a marathon every October.",
        "Bob's favourite editor is Emacs.",
    ],
}

FILL = """
import json, os
from django.test.utils import setup_test_environment
setup_test_environment()
from django.test import Client
facts = json.loads(os.environ["FACTS"])
for name, texts in facts.items():
    client = Client(HTTP_AUTHORIZATION="Bearer " + os.environ["KEY_" + name.upper()])
    for text in texts:
        response = client.post("/v1/memories", {"memory": text}, content_type="application/json")
        assert response.status_code == 201, response.content
"""

SNAPSHOT = """
import json
from django.conf import settings
from django.db import connection
from audit.models import AuditEvent, MemoryHistory
from billing.models import UsageEvent
from memsite.dbinfo import database_info
with connection.cursor() as cursor:
    cursor.execute(
        f'SELECT id::text, payload, vector::text FROM "{settings.MEMORY_COLLECTION}" ORDER BY id'
    )
    memories = [list(row) for row in cursor.fetchall()]
info = database_info()
print(json.dumps({
    "memories": memories,
    "audit": [dict(r) for r in AuditEvent.objects.order_by("pk").values()],
    "history": [dict(r) for r in MemoryHistory.objects.order_by("pk").values()],
    "usage": [dict(r) for r in UsageEvent.objects.order_by("pk").values()],
    "postgres": info.server_version,
    "pgvector": info.pgvector_version,
    "iterative_index_scans": info.iterative_index_scans,
}, default=str, sort_keys=True))
"""

SEARCH = """
import json, os
from django.test.utils import setup_test_environment
setup_test_environment()
from django.test import Client
found = {}
for name, texts in json.loads(os.environ["FACTS"]).items():
    client = Client(HTTP_AUTHORIZATION="Bearer " + os.environ["KEY_" + name.upper()])
    for text in texts:
        response = client.post("/v1/memories/search", {"query": text, "top_k": 1}, content_type="application/json")
        assert response.status_code == 200, response.content
        found[text] = [item["memory"] for item in response.json()["results"]]
print(json.dumps(found))
"""


class DataDir:
    def __init__(self, path: Path):
        self.path = path
        self.keys: dict[str, str] = {}

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DATABASE_NAME", "CELERY_BROKER_URL")}
        env.update(MEMSITE_DATA_DIR=str(self.path), MEMSITE_ENV="local", FACTS=json.dumps(FACTS))
        env.update({f"KEY_{name.upper()}": key for name, key in self.keys.items()})
        return env

    def manage(self, *args: str) -> str:
        result = subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=self.env(), capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    def python(self, code: str):
        return json.loads(self.manage("shell", "-c", code).strip().splitlines()[-1])


def test_pgserver_16_data_dir_is_upgraded_with_everything_intact():
    # Unix socket paths must stay short, so not under pytest's deep tmp_path.
    with tempfile.TemporaryDirectory(prefix="msu-") as tmp:
        data = DataDir(Path(tmp) / "data")
        old = EmbeddedPostgres(data.path, bin_dir=_package_bin_dir("pgserver"), upgrade=False)
        assert old.try_lock()
        old.start()
        try:
            data.manage("migrate", "--noinput")
            for name in FACTS:
                data.keys[name] = data.manage("issue_api_key", name, "--create-user").strip().splitlines()[-1]
            data.python(FILL + "\nprint('{}')")
            before = data.python(SNAPSHOT)
        finally:
            old.process.kill()  # an unclean stop: the upgrade must recover the cluster first
            old.process.wait(10)
            old.release_lock()
        assert before["postgres"].startswith("16.") and before["pgvector"] == "0.6.2"
        assert len(before["memories"]) == 6 and len(before["usage"]) == 6 and len(before["history"]) >= 6
        assert len(before["audit"]) >= 6

        new = EmbeddedPostgres(data.path)
        assert new.try_lock()
        try:
            new.start()
            after = data.python(SNAPSHOT)
            found = data.python(SEARCH)
        finally:
            new.stop()
            new.release_lock()

        assert after["postgres"].startswith("18.")
        assert tuple(int(p) for p in after["pgvector"].split(".")) >= (0, 8, 0)
        assert after["iterative_index_scans"] is True
        for table in ("memories", "audit", "history", "usage"):
            assert after[table] == before[table], table
        assert found == {text: [text] for texts in FACTS.values() for text in texts}
        # The old cluster is kept for the operator; nothing half-done is left behind.
        assert (data.path / "postgres-16.pre-upgrade" / "PG_VERSION").read_text().strip() == "16"
        assert not (data.path / "postgres.upgrading").exists()
        assert not (data.path / "postgres.upgrading.done").exists()

        # A second start is a plain start (no upgrade, nothing to update).
        again = EmbeddedPostgres(data.path)
        assert again.try_lock()
        try:
            again.start()
            assert data.python(SNAPSHOT)["memories"] == before["memories"]
        finally:
            again.stop()
            again.release_lock()


def test_interrupted_swap_is_finished_on_next_start():
    """A crash between moving the old cluster aside and moving the new one in."""
    short = Path(tempfile.mkdtemp(prefix="msi-"))
    try:
        pg = EmbeddedPostgres(short)
        staging = short / "postgres.upgrading"
        staging.mkdir()
        (staging / "PG_VERSION").write_text("18\n")
        (short / "postgres.upgrading.done").touch()
        (short / "postgres-16.pre-upgrade").mkdir()
        pg._recover_interrupted_upgrade()
        assert (short / "postgres" / "PG_VERSION").read_text() == "18\n"
        assert not staging.exists() and not (short / "postgres.upgrading.done").exists()

        # Without the marker a pre-upgrade cluster is no upgrade's leftover (the old cluster moves
        # aside only after the new one is complete): see the next test.
    finally:
        import shutil

        shutil.rmtree(short, ignore_errors=True)


def test_a_moved_away_cluster_is_not_replaced_by_the_pre_upgrade_one():
    """An operator moved postgres/ away after an upgrade (the restore docs say so): the next
    start must not put postgres-16.pre-upgrade back, which would serve data from before the
    upgrade, including data erased since. It refuses, and says what to do."""
    short = Path(tempfile.mkdtemp(prefix="msm-"))
    try:
        backup = short / "postgres-16.pre-upgrade"
        backup.mkdir()
        (backup / "PG_VERSION").write_text("16\n")
        (short / "postgres.moved-aside").mkdir()
        (short / "postgres.moved-aside" / "PG_VERSION").write_text("18\n")
        pg = EmbeddedPostgres(short)
        assert pg.try_lock()
        try:
            with pytest.raises(RuntimeError) as refused:
                pg.start()
        finally:
            pg.release_lock()
        message = str(refused.value)
        assert "postgres is missing" in message and "postgres-16.pre-upgrade" in message
        assert "holds the data from before the PostgreSQL upgrade" in message
        assert pg.process is None
        assert not (short / "postgres").exists()
        assert (backup / "PG_VERSION").read_text() == "16\n"
    finally:
        import shutil

        shutil.rmtree(short, ignore_errors=True)
