"""`bin/dr-drill`: a disaster-recovery drill with measured RTO and RPO.

1. Start a fresh service (the launcher: embedded Postgres with WAL archiving, web, worker,
   beat) in a temporary directory; its first base backup is taken at start.
2. Load data, then keep writing through the product path (REST `remember`, which also writes
   an audit row and a usage event in the same transaction), recording each acknowledged id
   and when the acknowledgement arrived.
3. Disaster: SIGKILL Postgres and the launcher, `rm -rf` the whole data dir.
4. `manage.py restore --to latest` into a fresh data dir, start the service again.
5. Check that every memory acknowledged before the recovery point is there, with its audit
   row and its usage event.
6. Print RTO (destruction -> a healthy service answering an authenticated call) and RPO
   (last acknowledged write -> recovery point), as text and JSON.

Backups live outside the data dir (as they must: a disk that dies takes the data dir), in a
directory or, with `--s3`, in a bucket with object lock on moto's S3 server on loopback.
Exit status 0 only when no acknowledged write before the recovery point is missing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _say(line: str) -> None:
    print(f"[dr-drill {datetime.now(UTC).strftime('%H:%M:%S')}] {line}", flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _http(method: str, url: str, token: str | None = None, body: dict | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)  # noqa: S310 - http to loopback
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - loopback only
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    except (OSError, ValueError):
        return 0, {}


@dataclass
class Ack:
    memory_id: str
    at: datetime


class FakeS3:
    """moto's S3 server on loopback, a bucket with object lock (`--s3`; moto is a dev dependency)."""

    bucket = "memsite-drill"

    def __init__(self) -> None:
        import boto3
        from moto.server import ThreadedMotoServer

        self.port = _free_port()
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id="drill",
            aws_secret_access_key="drill",  # noqa: S106 - moto on loopback
            region_name="us-east-1",
        )
        self.client.create_bucket(Bucket=self.bucket, ObjectLockEnabledForBucket=True)

    def env(self) -> dict[str, str]:
        return {
            "BACKUP_S3_BUCKET": self.bucket,
            "BACKUP_S3_ENDPOINT_URL": self.url,
            "BACKUP_S3_ACCESS_KEY_ID": "drill",
            "BACKUP_S3_SECRET_ACCESS_KEY": "drill",
            "BACKUP_S3_REGION": "us-east-1",
            "BACKUP_OBJECT_LOCK_MODE": "COMPLIANCE",
            "BACKUP_OBJECT_LOCK_DAYS": "1",
        }

    def objects(self, prefix: str) -> list[dict]:
        # Every page: one ListObjectsV2 answer holds at most 1,000 keys, the first in key order.
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=f"postgres/{prefix}")
        return [obj for page in pages for obj in page.get("Contents", [])]

    def stop(self) -> None:
        self.server.stop()


@dataclass
class Drill:
    workdir: Path
    archive_timeout_s: int
    s3: FakeS3 | None = None
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    launcher: subprocess.Popen | None = None
    token: str = ""

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    @property
    def backup_dir(self) -> Path:
        return self.workdir / "backups"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __post_init__(self) -> None:
        self.port = _free_port()
        drop = ("DATABASE_URL", "DATABASE_NAME", "CELERY_BROKER_URL", "BACKUP_S3_BUCKET", "DJANGO_SETTINGS_MODULE")
        self.env = {k: v for k, v in os.environ.items() if k not in drop}
        self.env.update(
            MEMSITE_ENV="local",
            MEMSITE_DATA_DIR=str(self.data_dir),
            BACKUP_DIR=str(self.backup_dir),
            BACKUP_ENABLED="true",
            BACKUP_ARCHIVE_TIMEOUT_S=str(self.archive_timeout_s),
            PORT=str(self.port),
            RATE_LIMIT_REMEMBER="0",
            RATE_LIMIT_LIST_MEMORY="0",
            MEMSITE_LOG_TO_FILES="1",
        )
        if self.s3:
            self.env.update(self.s3.env())

    # -- service ---------------------------------------------------------------------------
    def start(self, timeout: float = 180) -> None:
        log = open(self.workdir / "launcher.log", "ab")  # noqa: SIM115 - handed to the child
        self.launcher = subprocess.Popen(
            [sys.executable, "-m", "memsite.launcher"],
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.launcher.poll() is not None:
                raise DrillError(f"the service exited with {self.launcher.returncode}; see {self.workdir}/launcher.log")
            if time.monotonic() > deadline:
                raise DrillError(f"the service was not healthy after {timeout}s; see {self.workdir}/launcher.log")
            time.sleep(0.2)

    def healthy(self) -> bool:
        status, body = _http("GET", f"{self.url}/healthz")
        if status != 200 or body.get("status") != "ok":
            return False
        if not self.token:
            return True
        # Serving = an authenticated call reads the restored data, not just a live process.
        return _http("GET", f"{self.url}/v1/memories?page_size=1", self.token)[0] == 200

    def manage(self, *args: str) -> str:
        result = subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True, text=True
        )
        if result.returncode != 0:
            raise DrillError(f"manage.py {args[0]} failed: {result.stderr.strip()[-2000:]}")
        return result.stdout

    def stop(self) -> None:
        if self.launcher and self.launcher.poll() is None:
            self.launcher.send_signal(signal.SIGTERM)
            try:
                self.launcher.wait(60)
            except subprocess.TimeoutExpired:
                self.launcher.kill()
                self.launcher.wait()

    def wait_for_base_backup(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not self._base_backup_done():
            if time.monotonic() > deadline:
                raise DrillError("no base backup appeared (the launcher takes one at start)")
            time.sleep(0.5)

    def _base_backup_done(self) -> bool:
        if self.s3:
            return any(o["Key"].endswith("/backup.json") for o in self.s3.objects("base/"))
        return bool(list((self.backup_dir / "base").glob("*/backup.json")))

    def last_archived(self) -> datetime | None:
        if self.s3:
            stamps = [o["LastModified"] for o in self.s3.objects("wal/")]
            return max(stamps).astimezone(UTC) if stamps else None
        archived = [p.stat().st_mtime for p in (self.backup_dir / "wal").glob("*.gz")]
        return datetime.fromtimestamp(max(archived), UTC) if archived else None

    # -- writes ----------------------------------------------------------------------------
    def remember(self, text: str) -> Ack | None:
        status, body = _http("POST", f"{self.url}/v1/memories", self.token, {"memory": text})
        if status != 201:
            return None
        return Ack(body["id"], datetime.now(UTC))

    def write_for(self, seconds: float, label: str, acks: list[Ack]) -> int:
        failures = 0
        deadline = time.monotonic() + seconds
        n = len(acks)
        while time.monotonic() < deadline:
            ack = self.remember(f"drill fact {label} {n}: the user's lucky number is {n * 7919 % 10007}")
            n += 1
            if ack:
                acks.append(ack)
            else:
                failures += 1
        return failures

    # -- disaster --------------------------------------------------------------------------
    def destroy(self) -> datetime:
        pidfile = self.data_dir / "postgres" / "postmaster.pid"
        pg_pid = int(pidfile.read_text().splitlines()[0])
        os.kill(pg_pid, signal.SIGKILL)  # the database crashes first, as with a lost disk
        destroyed = datetime.now(UTC)
        if self.launcher:
            self.launcher.kill()
            self.launcher.wait(30)
        shutil.rmtree(self.data_dir)
        return destroyed


class DrillError(RuntimeError):
    pass


# Signals that end the drill the way Ctrl-C does: `kill`, a CI job's timeout, a closed terminal.
STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class DrillStopped(Exception):
    """SIGTERM or SIGHUP arrived: raised in the main thread, as SIGINT raises KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def _stopping_signals_raise() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into DrillStopped, so `run`'s `finally` stops the service it
    started and removes its directory. By default they end the drill at once, and the
    launcher (a plain child: no signal reaches it) goes on running Postgres, web, worker and
    beat with nobody to stop them. A repeated signal is ignored while that cleanup runs,
    so it is not cut short."""

    def stop(signum: int, _frame: object) -> None:
        for sig in STOPPING_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise DrillStopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in STOPPING_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _verify(drill: Drill, acks: list[Ack], recovery_point: datetime) -> dict:
    import psycopg

    from memsite.embedded_pg import EmbeddedPostgres

    conninfo = EmbeddedPostgres(drill.data_dir).conninfo("memsite")
    ids = [a.memory_id for a in acks]
    with psycopg.connect(conninfo) as conn:
        memories = {str(r[0]) for r in conn.execute("SELECT id FROM memories WHERE id::text = ANY(%s)", [ids])}
        audit = {}
        for memory_ids, request_id in conn.execute(
            "SELECT memory_ids, request_id FROM audit_auditevent WHERE operation = 'remember' AND outcome = 'ok'"
        ):
            for memory_id in memory_ids or []:
                audit[str(memory_id)] = request_id
        usage = {
            str(r[0]) for r in conn.execute("SELECT request_id FROM billing_usageevent WHERE operation = 'remember'")
        }
    before = [a for a in acks if a.at <= recovery_point]
    after = [a for a in acks if a.at > recovery_point]
    lost = []
    for ack in before:
        missing = []
        if ack.memory_id not in memories:
            missing.append("memory")
        if ack.memory_id not in audit:
            missing.append("audit row")
        elif audit[ack.memory_id] not in usage:
            missing.append("usage event")
        if missing:
            lost.append({"id": ack.memory_id, "acknowledged_at": ack.at.isoformat(), "missing": missing})
    return {
        "acknowledged": len(acks),
        "acknowledged_before_recovery_point": len(before),
        "acknowledged_after_recovery_point": len(after),
        "after_point_but_recovered": sum(1 for a in after if a.memory_id in memories),
        "lost_before_recovery_point": lost,
    }


def run(*, load: int, write_seconds: float, archive_timeout_s: int, keep: bool, s3: bool = False) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="drill-", dir="/tmp"))  # short: unix socket paths
    bucket = FakeS3() if s3 else None
    drill = Drill(workdir, archive_timeout_s, bucket)
    where = f"s3://{bucket.bucket}/postgres (moto, object lock)" if bucket else str(drill.backup_dir)
    try:
        _say(f"1. fresh service in {workdir} (archive_timeout {archive_timeout_s}s, backups in {where})")
        drill.start()
        drill.token = drill.manage("issue_api_key", "drill", "--create-user").strip().splitlines()[-1]
        drill.wait_for_base_backup()
        acks: list[Ack] = []
        for i in range(load):
            if ack := drill.remember(f"drill fact load {i}: the user's favourite colour number is {i}"):
                acks.append(ack)
        _say(f"   loaded {len(acks)} memories; base backup present")
        _say(f"2. writing through REST remember for {write_seconds:.0f}s")
        failures = drill.write_for(write_seconds, "live", acks)
        last_ack = acks[-1].at
        _say(f"   {len(acks)} acknowledged writes ({failures} failed), last at {last_ack.isoformat()}")
        last_archived = drill.last_archived()

        _say("3. disaster: SIGKILL postgres and the service, rm -rf the data dir")
        destroyed = drill.destroy()
        t0 = time.monotonic()

        _say("4. restore --to latest into a fresh data dir")
        out = drill.manage("restore", "--to", "latest")
        for line in out.strip().splitlines():
            _say(f"   {line}")
        point_line = [line for line in out.splitlines() if line.startswith("recovery point: ")][-1]
        recovery_point = datetime.fromisoformat(point_line.removeprefix("recovery point: "))
        restored_s = time.monotonic() - t0
        drill.start()
        rto_s = time.monotonic() - t0
        _say(f"   healthy and serving {rto_s:.1f}s after the destruction (restore itself {restored_s:.1f}s)")

        _say("5. checking every acknowledged write before the recovery point")
        check = _verify(drill, acks, recovery_point)
        rpo_s = max(0.0, (last_ack - recovery_point).total_seconds())
        result = {
            "measured_at": destroyed.isoformat(),
            "target": "s3" if bucket else "dir",
            "archive_timeout_s": archive_timeout_s,
            "write_seconds": write_seconds,
            "rto_s": round(rto_s, 1),
            "restore_s": round(restored_s, 1),
            "rpo_s": round(rpo_s, 1),
            "last_acknowledged_write": last_ack.isoformat(),
            "last_archived_wal_at": last_archived.isoformat() if last_archived else None,
            "recovery_point": recovery_point.isoformat(),
            **check,
            "lost_before_recovery_point": len(check["lost_before_recovery_point"]),
            "lost": check["lost_before_recovery_point"][:10],
        }
        ok = not check["lost_before_recovery_point"]
        _say(
            f"   {check['acknowledged_before_recovery_point']} acknowledged before the recovery point: "
            + ("all present (memory, audit row, usage event)" if ok else f"{result['lost_before_recovery_point']} LOST")
        )
        _say(
            f"   {check['acknowledged_after_recovery_point']} acknowledged after it (the RPO window), "
            f"{check['after_point_but_recovered']} of them recovered anyway"
        )
        _say(f"6. RTO {rto_s:.1f} s   RPO {rpo_s:.1f} s   (targets: RTO <= 4 h, RPO ~5 min)")
        result["ok"] = ok
        return result
    finally:
        drill.stop()
        if bucket:
            bucket.stop()
        if keep:
            _say(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", type=int, default=50, help="memories written before the live phase")
    parser.add_argument("--write-seconds", type=float, default=30.0, help="length of the live write phase")
    parser.add_argument(
        "--archive-timeout", type=int, default=10, help="BACKUP_ARCHIVE_TIMEOUT_S for the drill (production: 60)"
    )
    parser.add_argument("--s3", action="store_true", help="back up to moto's S3 on loopback (object lock)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)
    try:
        with _stopping_signals_raise():
            result = run(
                load=args.load,
                write_seconds=args.write_seconds,
                archive_timeout_s=args.archive_timeout,
                keep=args.keep,
                s3=args.s3,
            )
    except DrillError as exc:
        _say(f"FAILED: {exc}")
        return 2
    except DrillStopped as exc:
        _say(f"stopped by {exc}; the service it started is stopped")
        return 128 + exc.signum
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
