"""Postgres' archive_command and restore_command for memsite's backups.

Run by the server itself (as its OS user, `pgserver` when memsite runs as root), once per WAL
segment, so it imports nothing of Django and only the standard library (boto3 only for an S3
target):

    python walarchive.py push CONFIG PATH NAME   # archive_command: store %p as %f
    python walarchive.py fetch CONFIG NAME DEST  # restore_command: fetch %f into %p

CONFIG is a JSON file written by memsite/backup.py (mode 0600, it may hold S3 keys):
{"kind": "dir", "path": ...} or {"kind": "s3", "bucket": ..., ...}.

Exit status 0 tells Postgres the segment is stored (push) or restored (fetch). push says 0
only once the compressed segment is durable: fsynced file and directory, or an S3 PUT that
returned with its Content-MD5 checked. Archiving a name again is answered 0 only when the
stored bytes are the same segment; different content fails (Postgres then retries and says
so in its log) rather than overwrite history.

fetch says 1 only when the file is not in the archive: to recovery that means "the WAL ends
here", and Postgres then ends recovery and promotes. Any other failure (a corrupt or truncated
segment, an unreadable config, the bucket not answering) exits FETCH_FAILED, above 125, which
Postgres treats like a signal: it aborts recovery instead of promoting with the rest of the
archive silently left out.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import sys
from pathlib import Path

WAL_PREFIX = "wal/"
# restore_command: an exit status above 125 is fatal to recovery (PostgreSQL docs,
# "Archive Recovery"); below it, any non-zero status reads as "no such file". Not 128 + a
# signal number Postgres treats specially (SIGTERM: 143).
FETCH_FAILED = 200


def _key(name: str) -> str:
    if "/" in name or name.startswith("."):
        raise ValueError(f"unexpected WAL file name {name!r}")
    return f"{WAL_PREFIX}{name}.gz"


# -- directory target -------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dir_push(config: dict, raw: bytes, name: str) -> None:
    dest = Path(config["path"]) / _key(name)
    digest = hashlib.sha256(raw).hexdigest()
    if dest.exists():
        if hashlib.sha256(gzip.decompress(dest.read_bytes())).hexdigest() == digest:
            return
        raise RuntimeError(f"{dest} exists with different content; refusing to overwrite")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        out.write(gzip.compress(raw, compresslevel=1, mtime=0))
        out.flush()
        os.fsync(out.fileno())
    try:
        os.link(tmp, dest)  # never replaces an existing file, unlike rename
    finally:
        tmp.unlink()
    _fsync_dir(dest.parent)


def _dir_fetch(config: dict, name: str) -> bytes | None:
    source = Path(config["path"]) / _key(name)
    try:
        body = source.read_bytes()
    except FileNotFoundError:
        return None
    return gzip.decompress(body)


# -- S3 target ----------------------------------------------------------------------------
def s3_client(config: dict):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=config.get("endpoint_url") or None,
        aws_access_key_id=config.get("access_key"),
        aws_secret_access_key=config.get("secret_key"),
        region_name=config.get("region") or "auto",
        config=Config(
            s3={"addressing_style": config.get("addressing_style") or "path"},
            retries={"max_attempts": 5, "mode": "standard"},
            connect_timeout=10,
            read_timeout=60,
        ),
    )


def s3_key(config: dict, key: str) -> str:
    prefix = (config.get("prefix") or "").strip("/")
    return f"{prefix}/{key}" if prefix else key


def s3_put(client, config: dict, key: str, body, metadata: dict[str, str] | None = None) -> None:
    """One PUT under object lock; S3 checks Content-MD5, so a 200 means these bytes are stored.
    `body`: bytes, or a file opened for reading in binary (streamed; single PUTs go to 5 GB)."""
    from datetime import UTC, datetime, timedelta

    if isinstance(body, bytes):
        md5 = hashlib.md5(body)  # noqa: S324 - integrity, not security
    else:
        md5 = hashlib.file_digest(body, "md5")
        body.seek(0)
    params = {
        "Bucket": config["bucket"],
        "Key": s3_key(config, key),
        "Body": body,
        "ContentMD5": base64.b64encode(md5.digest()).decode(),
        "Metadata": metadata or {},
    }
    if config.get("lock_mode"):
        params["ObjectLockMode"] = config["lock_mode"]
        params["ObjectLockRetainUntilDate"] = datetime.now(UTC) + timedelta(days=int(config.get("lock_days") or 1))
    client.put_object(**params)


def _s3_head(client, config: dict, key: str) -> dict | None:
    from botocore.exceptions import ClientError

    try:
        return client.head_object(Bucket=config["bucket"], Key=s3_key(config, key))
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def _s3_push(config: dict, raw: bytes, name: str) -> None:
    client = s3_client(config)
    key = _key(name)
    digest = hashlib.sha256(raw).hexdigest()
    head = _s3_head(client, config, key)
    if head is not None:
        if head.get("Metadata", {}).get("sha256") == digest:
            return
        raise RuntimeError(f"{key} exists in the bucket with different content; refusing to overwrite")
    s3_put(client, config, key, gzip.compress(raw, compresslevel=1, mtime=0), {"sha256": digest})


def _s3_fetch(config: dict, name: str) -> bytes | None:
    client = s3_client(config)
    key = _key(name)
    if _s3_head(client, config, key) is None:
        return None
    body = client.get_object(Bucket=config["bucket"], Key=s3_key(config, key))["Body"].read()
    return gzip.decompress(body)


# -- entry points ---------------------------------------------------------------------------
def push(config: dict, path: Path, name: str) -> None:
    raw = path.read_bytes()
    (_s3_push if config["kind"] == "s3" else _dir_push)(config, raw, name)


def fetch(config: dict, name: str, dest: Path) -> bool:
    """False only when `name` is not in the archive; a stored file that cannot be read whole
    raises (gzip checks the CRC and length of what it decompresses)."""
    raw = (_s3_fetch if config["kind"] == "s3" else _dir_fetch)(config, name)
    if raw is None:
        return False
    if not raw:
        raise ValueError(f"archived {name} is empty")
    with open(dest, "wb") as out:
        out.write(raw)
    return True


def main(argv: list[str]) -> int:
    # A failed push is retried by Postgres (exit 1); a failed fetch must stop recovery, which
    # reads any status of 125 or less as "the WAL ends here".
    failed = FETCH_FAILED if argv[:1] == ["fetch"] else 1
    try:
        command, config_path, *rest = argv
        config = json.loads(Path(config_path).read_text())
        if command == "push" and len(rest) == 2:
            push(config, Path(rest[0]), rest[1])
            return 0
        if command == "fetch" and len(rest) == 2:
            # A missing file is normal (Postgres probes for history files and the next
            # segment): exit 1 quietly.
            return 0 if fetch(config, rest[0], Path(rest[1])) else 1
        sys.stderr.write(__doc__ or "")
        return failed if command == "fetch" else 2
    except Exception as exc:
        # Never print the config: it may hold keys.
        sys.stderr.write(f"walarchive {argv[:1]} failed: {type(exc).__name__}: {exc}\n")
        return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
