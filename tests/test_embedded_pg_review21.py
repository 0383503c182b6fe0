"""Review 21: a stale postmaster.pid whose pid now belongs to another PostgreSQL (another
data directory) no longer blocks the start; one whose postgres runs on our data directory
still does, with a clear message. Our lock already proves no memsite runs it."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import psutil
import pytest

from memsite.embedded_pg import EmbeddedPostgres, _data_dir_argument
from tests.environment import TEST_DATA_DIR


@pytest.fixture
def server(tmp_path) -> EmbeddedPostgres:
    server = EmbeddedPostgres(tmp_path / "data")
    server.paths.pgdata.mkdir(parents=True)
    return server


def _pidfile(server: EmbeddedPostgres, pid: int) -> Path:
    pidfile = server.paths.pgdata / "postmaster.pid"
    pidfile.write_text(f"{pid}\n{server.paths.pgdata}\n1700000000\n5432\n")
    return pidfile


@pytest.fixture
def other_postmaster() -> psutil.Process:
    """The test session's own embedded PostgreSQL: a real one, on another data directory."""
    pidfile = EmbeddedPostgres(TEST_DATA_DIR).paths.pgdata / "postmaster.pid"
    if not pidfile.exists():
        pytest.skip("the tests run on a Postgres of DATABASE_URL, not an embedded one")
    return psutil.Process(int(pidfile.read_text().splitlines()[0]))


@pytest.fixture
def postgres_named(tmp_path):
    """Start a process named `postgres` (a shell script of that name, waiting) in a given
    directory, with the given arguments."""
    started: list[subprocess.Popen] = []
    script = tmp_path / "bin" / "postgres"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\nwhile :; do sleep 1; done\n")
    script.chmod(0o755)

    def start(cwd: Path, *args: str) -> int:
        process = subprocess.Popen([str(script), *args], cwd=cwd)
        started.append(process)
        return process.pid

    yield start
    for process in started:
        process.kill()
        process.wait()


def test_a_pid_reused_by_another_postmaster_is_a_stale_pidfile(server, other_postmaster, caplog):
    pidfile = _pidfile(server, other_postmaster.pid)
    with caplog.at_level(logging.WARNING, logger="memsite.embedded_pg"):
        server._remove_stale_pidfile()
    assert not pidfile.exists()
    assert "is now a postgres of another data directory" in caplog.text


def test_a_pid_reused_by_another_postgres_backend_is_a_stale_pidfile(server, other_postmaster):
    (backend, *_) = other_postmaster.children()  # its checkpointer, writer...: no -D of their own
    pidfile = _pidfile(server, backend.pid)
    server._remove_stale_pidfile()
    assert not pidfile.exists()


def test_a_postgres_running_on_our_data_dir_still_blocks_the_start(server, postgres_named):
    pidfile = _pidfile(server, postgres_named(server.paths.pgdata))
    assert psutil.Process(int(pidfile.read_text().split()[0])).name() == "postgres"
    with pytest.raises(RuntimeError, match=rf"already runs on {server.paths.pgdata} outside our lock"):
        server._remove_stale_pidfile()
    assert pidfile.exists()


def test_where_the_working_directory_cannot_be_read_the_data_dir_argument_decides(
    server, postgres_named, tmp_path, monkeypatch
):
    def denied(self):
        raise psutil.AccessDenied(self.pid)

    monkeypatch.setattr(psutil.Process, "cwd", denied)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    pidfile = _pidfile(server, postgres_named(tmp_path, "-D", str(server.paths.pgdata)))
    with pytest.raises(RuntimeError, match="already runs on"):
        server._remove_stale_pidfile()

    _pidfile(server, postgres_named(tmp_path, "-D", str(elsewhere)))
    server._remove_stale_pidfile()
    assert not pidfile.exists()

    _pidfile(server, postgres_named(tmp_path))  # no -D: where it runs cannot be told
    with pytest.raises(RuntimeError, match=rf"could not be read; if it does not run on {server.paths.pgdata}, remove"):
        server._remove_stale_pidfile()
    assert pidfile.exists()


def test_a_backend_whose_directory_cannot_be_read_is_told_by_its_postmaster(server, other_postmaster, monkeypatch):
    """Another OS user's server: a backend's command line is its process title, without
    `-D`; its postmaster's has it."""
    if _data_dir_argument(other_postmaster.cmdline()) is None:
        pytest.skip("this postmaster was started without an absolute -D")

    def denied(self):
        raise psutil.AccessDenied(self.pid)

    monkeypatch.setattr(psutil.Process, "cwd", denied)
    (backend, *_) = other_postmaster.children()
    pidfile = _pidfile(server, backend.pid)
    server._remove_stale_pidfile()
    assert not pidfile.exists()
