"""The suite (and every process it starts) refuses non-loopback network access.

These tests never send anything: the audit hook fires before the syscall, and the
attempts below are raised with sys.audit directly."""

import socket
import sys

import netguard
import pytest


@pytest.fixture(autouse=True)
def separate_log(tmp_path, monkeypatch):
    """Deliberate attempts here go to their own log, not the session's."""
    log = tmp_path / "netguard.log"
    monkeypatch.setenv(netguard.LOG_ENV, str(log))
    return log


@pytest.mark.parametrize(
    "address",
    [("127.0.0.1", 80), ("127.8.9.1", 5432), ("::1", 80, 0, 0), ("localhost", 8000)],
)
def test_loopback_is_allowed(address):
    sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET)
    try:
        assert netguard.is_allowed("socket.connect", (sock, address))
    finally:
        sock.close()


@pytest.mark.parametrize("host", ["10.1.2.3", "8.8.8.8", "us.i.posthog.com", "2001:db8::1", "example.org"])
def test_everything_else_is_refused(host, separate_log):
    sock = socket.socket(socket.AF_INET)
    try:
        with pytest.raises(netguard.NetworkRefused):
            sys.audit("socket.connect", sock, (host, 443))
        with pytest.raises(netguard.NetworkRefused):
            sys.audit("socket.getaddrinfo", host, 443, 0, 0, 0)
    finally:
        sock.close()
    assert host in separate_log.read_text()


def test_the_guard_is_installed_in_subprocesses(separate_log):
    import os
    import subprocess

    code = "import sys,socket; s=socket.socket(); sys.audit('socket.connect', s, ('203.0.113.9', 1))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert result.returncode != 0
    assert "NetworkRefused" in result.stderr
    assert "203.0.113.9" in separate_log.read_text()
