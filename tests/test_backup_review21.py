"""Review 21: a manage.py command run while the service is stopped starts the embedded
database for itself; a backup target that is down (S3 unreachable) no longer makes every
command crash with a traceback. The command runs, with a one-line warning naming no secret,
WAL archiving still on (Postgres keeps the segments until they can be archived); a start
that cannot be done is one line too."""

from __future__ import annotations

import psycopg
import pytest

from memsite.embedded_pg import EmbeddedPostgres, postgres_os_user
from memsite.launcher import embedded_database_for_command
from tests.conftest import free_port

pytestmark = pytest.mark.slow

SECRET = "s3cret-of-the-backup-bucket"


@pytest.fixture
def stopped_service(settings, tmp_path):
    """settings of a data dir whose database does not run, with backups on."""
    settings.DATA_DIR = tmp_path / "data"
    settings.EMBEDDED_DATABASE = True
    settings.BACKUP_ENABLED = True
    settings.BACKUP_DIR = tmp_path / "backups"
    return settings


def test_a_command_runs_while_the_s3_target_is_unreachable(stopped_service, capsys):
    if postgres_os_user() is None:
        pytest.skip("the archive command is only probed when the server runs as another OS user")
    stopped_service.BACKUP_S3_BUCKET = "memsite-backups"
    stopped_service.BACKUP_S3_ENDPOINT_URL = f"http://127.0.0.1:{free_port()}"  # nobody listens
    stopped_service.BACKUP_S3_ACCESS_KEY_ID = "drill"
    stopped_service.BACKUP_S3_SECRET_ACCESS_KEY = SECRET
    stopped_service.BACKUP_S3_REGION = "us-east-1"

    with embedded_database_for_command():
        conninfo = EmbeddedPostgres(stopped_service.DATA_DIR).conninfo("postgres")
        with psycopg.connect(conninfo) as conn:
            archive_mode = conn.execute("SHOW archive_mode").fetchone()

    assert archive_mode == ("on",)
    warning = capsys.readouterr().err
    assert warning.startswith("manage.py: warning: the WAL archive command, run as")
    assert "WAL archiving stays on" in warning and warning.count("\n") == 1
    assert SECRET not in warning


def test_a_database_that_cannot_start_for_a_command_is_one_line(stopped_service, tmp_path):
    (tmp_path / "not-a-dir").write_text("")
    stopped_service.BACKUP_DIR = tmp_path / "not-a-dir" / "backups"

    with pytest.raises(SystemExit) as stopped, embedded_database_for_command():
        pytest.fail("the command ran")

    assert str(stopped.value).startswith("manage.py: the embedded database did not start: ")
    assert "not-a-dir" in str(stopped.value)


def test_the_probes_error_is_redacted_before_it_is_cut(tmp_path, monkeypatch):
    """The last 500 characters were kept first and redacted after: a key the cut split in
    two no longer matched, and its tail was printed."""
    import json
    import pwd
    import subprocess

    from memsite import backup

    config = tmp_path / "archive.json"
    config.write_text(json.dumps({"secret_key": SECRET, "access_key": "AKIAEXAMPLE"}))
    # The secret starts 505 characters from the end: a cut at 500 splits it.
    stderr = "failed: " + SECRET + "x" * (505 - len(SECRET))
    monkeypatch.setattr(backup, "_grant_traversal", lambda path: None)
    monkeypatch.setattr(
        backup.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 2, stdout="", stderr=stderr)
    )
    with pytest.raises(backup.BackupError) as failed:
        backup._check_runs_as(pwd.getpwuid(0).pw_name, config)
    assert SECRET[-8:] not in str(failed.value)
