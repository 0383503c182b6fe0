"""Audit export to S3 with object lock, against moto's S3 server on loopback."""

from __future__ import annotations

import gzip
import hashlib
import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.files.storage import storages
from django.core.management import call_command
from django.utils import timezone

from audit.export import audit_export
from audit.models import AuditEvent, AuditExportBatch
from audit.storage import LockedS3Storage
from tests.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
BUCKET = "memsite-audit"
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


@pytest.fixture(scope="module")
def s3_server():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3(s3_server, settings):
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server, **CREDENTIALS)
    existing = {b["Name"] for b in client.list_buckets()["Buckets"]}
    bucket = f"{BUCKET}-{len(existing)}"
    client.create_bucket(Bucket=bucket, ObjectLockEnabledForBucket=True)
    settings.STORAGES = {
        **settings.STORAGES,
        "audit": {
            "BACKEND": "audit.storage.LockedS3Storage",
            "OPTIONS": {
                "bucket_name": bucket,
                "endpoint_url": s3_server,
                "access_key": "testing",
                "secret_key": "testing",
                "region_name": "us-east-1",
                "location": "audit",
                "addressing_style": "path",
                "file_overwrite": False,
                "object_lock_mode": "COMPLIANCE",
                "object_lock_days": 30,
            },
        },
    }
    settings.AUDIT_EXPORT_LAG_S = 0
    return client, bucket


def _make_rows(n: int) -> list[int]:
    old = timezone.now() - timedelta(minutes=1)
    AuditEvent.objects.bulk_create(
        AuditEvent(request_id=f"req-{i}", channel="mcp", operation="remember", outcome="ok", occurred_at=old)
        for i in range(n)
    )
    return list(AuditEvent.objects.order_by("id").values_list("id", flat=True))


def _objects(client, bucket) -> dict[str, bytes]:
    listing = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listing}


def _exported_ids(objects: dict[str, bytes]) -> list[int]:
    ids = []
    for key, body in objects.items():
        if key.endswith(".jsonl.gz"):
            ids += [json.loads(line)["id"] for line in gzip.decompress(body).decode().splitlines()]
    return ids


def test_export_locks_objects_and_matches_manifests(s3):
    client, bucket = s3
    ids = _make_rows(95)

    out = StringIO()
    call_command("export_audit", "--batch-size", "40", stdout=out)
    assert "exported 95 rows in 3 batches" in out.getvalue()

    objects = _objects(client, bucket)
    data_keys = sorted(k for k in objects if k.endswith(".jsonl.gz"))
    assert len(data_keys) == 3 and len([k for k in objects if k.endswith(".manifest.json")]) == 3
    for key in data_keys:
        head = client.head_object(Bucket=bucket, Key=key)
        assert head["ObjectLockMode"] == "COMPLIANCE"
        assert head["ObjectLockRetainUntilDate"] > timezone.now() + timedelta(days=29)
        manifest = json.loads(objects[key.replace(".jsonl.gz", ".manifest.json")])
        assert manifest["sha256"] == hashlib.sha256(objects[key]).hexdigest()
        assert manifest["object"] == key.removeprefix("audit/")
    assert sorted(_exported_ids(objects)) == ids

    # A second run finds nothing new.
    assert audit_export(batch_size=40).rows == 0
    assert len(_objects(client, bucket)) == 6

    # New rows go in a new batch after the watermark.
    _make_rows(5)
    report = audit_export(batch_size=40)
    assert report.rows == 5 and report.batches == 1


class CrashingStorage(LockedS3Storage):
    """The process dies after `survive` uploads (fault injected at the S3 boundary)."""

    survive = 3

    def _save(self, name, content):
        if CrashingStorage.survive == 0:
            raise SystemExit("killed mid-export")
        CrashingStorage.survive -= 1
        return super()._save(name, content)


def test_export_killed_halfway_then_rerun_exports_every_row_once(s3, settings):
    client, bucket = s3
    ids = _make_rows(100)
    options = settings.STORAGES["audit"]["OPTIONS"]

    CrashingStorage.survive = 3  # batch 1: object + manifest; batch 2: object, then death
    with pytest.raises(SystemExit):
        audit_export(batch_size=40, storage=CrashingStorage(**options))
    assert AuditExportBatch.objects.count() == 1
    assert len(_objects(client, bucket)) == 3

    report = audit_export(batch_size=40, storage=storages["audit"])

    assert report.reused_objects == 1  # batch 2's object was already there, byte for byte
    exported = _exported_ids(_objects(client, bucket))
    assert sorted(exported) == ids and len(exported) == len(set(exported))
    assert AuditExportBatch.objects.count() == 3
    assert audit_export(batch_size=40).rows == 0


def test_a_row_stamped_later_than_the_next_id_is_not_left_behind(s3, settings):
    """ids come from the sequence at insert, occurred_at from each process's clock before
    it: id 100 can be stamped after id 101 (a host whose clock is ahead, a process paused
    between the two). A batch chosen by time took 101, moved the watermark past 100, and
    100 was never exported (retention would then delete it)."""
    client, bucket = s3
    settings.AUDIT_EXPORT_LAG_S = 300
    now = timezone.now()
    ahead, behind = (
        AuditEvent.objects.create(request_id=f"req-{n}", channel="mcp", operation="remember", outcome="ok",
                                  occurred_at=at)
        for n, at in ((1, now - timedelta(seconds=60)), (2, now - timedelta(seconds=600)))
    )  # fmt: skip
    assert ahead.id < behind.id
    assert audit_export(batch_size=40).rows == 0  # the lower id is not settled yet: it waits, and so does 2
    settings.AUDIT_EXPORT_LAG_S = 30  # as if four and a half minutes passed
    assert audit_export(batch_size=40).rows == 2
    assert sorted(_exported_ids(_objects(client, bucket))) == [ahead.id, behind.id]
