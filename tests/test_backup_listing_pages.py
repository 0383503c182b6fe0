"""Session 32: a bucket's listings (base/, wal/, erasures/) are read one ListObjectsV2 page
at a time and reduced as they come, with the same results as from the whole listing. Before,
every listing was collected whole (one dict per object: years of WAL segments) before it was
reduced, finding the newest backup read every backup.json in the bucket, and the erasure
ledger was listed from its first record to pick those after a time."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from memsite import backup, walarchive
from tests.conftest import free_port

pytestmark = pytest.mark.slow
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
BUCKET = "memsite-pages"
PAGE = 2


@pytest.fixture
def bucket(settings, tmp_path):
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, **CREDENTIALS)
    client.create_bucket(Bucket=BUCKET)
    settings.DATA_DIR = tmp_path / "data"
    settings.EMBEDDED_DATABASE = True
    settings.BACKUP_ENABLED = True
    settings.BACKUP_BASE_INTERVAL_H = 24.0
    settings.BACKUP_S3_BUCKET = BUCKET
    settings.BACKUP_S3_ENDPOINT_URL = endpoint
    settings.BACKUP_S3_ACCESS_KEY_ID = "testing"
    settings.BACKUP_S3_SECRET_ACCESS_KEY = "testing"
    settings.BACKUP_S3_REGION = "us-east-1"
    settings.BACKUP_S3_PREFIX = "pg"
    settings.BACKUP_OBJECT_LOCK_MODE = None
    yield client
    server.stop()


@pytest.fixture
def requests(monkeypatch) -> list[tuple[str, dict]]:
    """What backup.py asked the bucket: (operation, parameters), and each listing's key count."""
    seen: list[tuple[str, dict]] = []
    make = walarchive.s3_client

    def client(config: dict):
        made = make(config)
        made.meta.events.register(
            "before-parameter-build.s3.*", lambda model, params, **_: seen.append((model.name, dict(params)))
        )
        made.meta.events.register(
            "after-call.s3.ListObjectsV2", lambda parsed, **_: seen.append(("listed", {"keys": parsed["KeyCount"]}))
        )
        return made

    monkeypatch.setattr(walarchive, "s3_client", client)
    # raising=False: the code before paging had no such setting, and must fail on what it asks.
    monkeypatch.setattr(backup, "S3_LIST_PAGE_SIZE", PAGE, raising=False)
    return seen


def _meta(label: str, finished: datetime, start_wal: str) -> dict:
    files = {name: {"size": 1, "sha256": "0" * 64} for name in backup.BASE_FILES}
    return {
        "label": label,
        "started_at": (finished - timedelta(minutes=1)).isoformat(),
        "finished_at": finished.isoformat(),
        "start_wal": start_wal,
        "end_lsn": "0/3000100",
        "server_version": "17.2",
        "files": files,
    }


def _put(client, key: str, body: bytes = b"x") -> None:
    client.put_object(Bucket=BUCKET, Key=f"pg/{key}", Body=body)


def _whole(client, prefix: str) -> list[dict]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"pg/{prefix}")
    return [o for page in pages for o in page.get("Contents", [])]


def test_the_listings_are_read_page_by_page_with_the_whole_listings_results(bucket, requests):
    now = datetime.now(UTC)
    metas = []
    for n in range(5):
        finished = now - timedelta(hours=5 - n)
        meta = _meta(finished.strftime("%Y%m%dT%H%M%S%fZ"), finished, f"00000001000000000000000{2 * n + 1}")
        metas.append(meta)
        _put(bucket, f"base/{meta['label']}/base.tar.gz")
        _put(bucket, f"base/{meta['label']}/{backup.META}", json.dumps(meta).encode())
    segments = [f"0000000{t}00000000000000{s:02X}" for t, s in [(1, 1), (1, 2), (1, 3), (1, 4), (2, 4), (2, 5), (2, 6)]]
    for name in segments:
        _put(bucket, f"wal/{name}.gz")
    _put(bucket, "wal/00000002.history.gz")
    _put(bucket, "wal/000000010000000000000003.00000028.backup.gz")
    records = []
    for n in range(5):
        erased_at = now - timedelta(days=5 - n)
        record = {"id": f"r{n}", "erased_at": erased_at.isoformat()}
        records.append(record)
        name = backup.erasure_record_name(erased_at=erased_at, ledger_id=record["id"])
        _put(bucket, f"{backup.ERASURES}/{name}", json.dumps(record).encode())

    # The newest backup is recent: nothing is due, and only its backup.json was read.
    requests.clear()
    assert backup.backup_base_if_due() is None
    read = [p["Key"] for op, p in requests if op == "GetObject"]
    assert read == [f"pg/base/{metas[-1]['label']}/{backup.META}"]
    assert backup.backups_list() == metas

    # A damaged newest backup.json is skipped, as backups_list skips it: the one before decides.
    _put(bucket, f"base/{metas[-1]['label']}/{backup.META}", b'{"lab')
    requests.clear()
    assert backup.backup_base_if_due() is None
    read = [p["Key"] for op, p in requests if op == "GetObject"]
    assert read == [f"pg/base/{m['label']}/{backup.META}" for m in (metas[-1], metas[-2])]
    assert backup.backups_list() == metas[:-1]

    # The WAL's status, from as many pages as its keys need, as from the whole listing.
    wal = sorted(
        (o["Key"].rsplit("/", 1)[-1].removesuffix(".gz"), o["LastModified"].timestamp())
        for o in _whole(bucket, "wal/")
        if backup._SEGMENT.match(o["Key"].rsplit("/", 1)[-1].removesuffix(".gz"))
    )
    requests.clear()
    status = backup.archive_status()
    assert status.wal_files == len(segments) == len(wal)
    newest = max(wal, key=lambda item: item[1])
    assert (status.newest_wal, status.newest_wal_at) == (newest[0], datetime.fromtimestamp(newest[1], UTC))
    listings = [p for op, p in requests if op == "ListObjectsV2"]
    assert {p["MaxKeys"] for p in listings} == {PAGE}
    wal_pages = [p for p in listings if p["Prefix"] == "pg/wal/"]
    assert len(wal_pages) == 5  # 9 keys, 2 a page
    assert all(keys <= PAGE for keys in (p["keys"] for op, p in requests if op == "listed"))

    # What a restore from the third backup reads: its segments on, and the newest time of all.
    since, newest_at = backup._wal_since(backup._target(), metas[2])
    assert since == [(n, t) for n, t in wal if n[8:] >= metas[2]["start_wal"][8:]]
    assert newest_at == max(t for _, t in wal)

    # The ledger from a time on: the bucket starts the listing there.
    requests.clear()
    assert backup.erasure_records(after=now - timedelta(days=2, hours=12)) == records[3:]
    listings = [p for op, p in requests if op == "ListObjectsV2"]
    assert all(p["StartAfter"].startswith("pg/erasures/") for p in listings)
    assert sum(p["keys"] for op, p in requests if op == "listed") == 2
    assert backup.erasure_records() == records
