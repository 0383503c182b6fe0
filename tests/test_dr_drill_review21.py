"""Review 21: bin/dr-drill stopped by SIGTERM or SIGHUP stops the service it started and
removes its directory, as Ctrl-C does (the whole drill is test_backup.py's
test_disaster_drill; here the service is a stand-in process, the signal path is real)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.environment import ROOT

# The drill with its service replaced by a sleeping child, busy in a `manage.py` step.
DRILL = """
import subprocess, sys, time
from memsite import drill

def start(self, timeout=180):
    self.launcher = subprocess.Popen(  # its output elsewhere, as the launcher's goes to a log
        [sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    print(f"launcher {self.launcher.pid}", flush=True)

def manage(self, *args):
    time.sleep(600)

drill.Drill.start = start
drill.Drill.manage = manage
sys.exit(drill.main(["--load", "0"]))
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stopped_drill_stops_the_service_it_started(sig):
    drill = subprocess.Popen(
        [sys.executable, "-c", DRILL], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert drill.stdout is not None
    launcher = 0
    output = []
    try:
        for line in drill.stdout:
            output.append(line)
            if match := re.match(r"launcher (\d+)", line):
                launcher = int(match[1])
                break
        workdir = Path(re.search(r"fresh service in (\S+)", "".join(output))[1])
        assert launcher and _alive(launcher) and workdir.is_dir()

        drill.send_signal(sig)
        rest, _ = drill.communicate(timeout=60)

        assert drill.returncode == 128 + sig, "".join(output) + rest
        assert f"stopped by {sig.name}" in rest
        assert not _alive(launcher)
        assert not workdir.exists()
    finally:
        if "workdir" in locals():  # left behind when the cleanup did not run
            shutil.rmtree(workdir, ignore_errors=True)
        drill.kill()
        drill.wait()
        if launcher and _alive(launcher):
            os.kill(launcher, signal.SIGKILL)


def test_the_drill_sees_every_object_of_a_bucket_prefix_past_the_first_thousand(tmp_path):
    """S3 answers a listing 1,000 keys at a time: the drill read the first answer only, so
    a bucket with more keys under base/ (or wal/) hid the rest, in key order. A base backup
    whose backup.json sorts after them was never seen, and the newest WAL was missed.
    moto's S3 server on loopback, as the drill's `--s3` runs it."""
    from memsite import drill

    bucket = drill.FakeS3()
    try:
        for n in range(1000):
            bucket.client.put_object(Bucket=bucket.bucket, Key=f"postgres/base/a-{n:04d}/base.tar.gz", Body=b"")
        run = drill.Drill(tmp_path, 1, bucket)
        assert not run._base_backup_done()
        bucket.client.put_object(Bucket=bucket.bucket, Key="postgres/base/b-0000/backup.json", Body=b"{}")
        assert len(bucket.objects("base/")) == 1001
        assert run._base_backup_done()
    finally:
        bucket.stop()
