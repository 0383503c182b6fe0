"""Refuse, and record, any network connection that leaves this machine.

Installed as a Python audit hook in the test process and, through sitecustomize.py on
PYTHONPATH, in every Python subprocess the tests start (launcher, web, worker, beat).
The hook runs before the connect/lookup syscall, so nothing is ever sent."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import traceback

LOG_ENV = "MEMSITE_NETGUARD_LOG"
LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", ""}


class NetworkRefused(ConnectionRefusedError):
    pass


def _is_loopback_host(host) -> bool:
    if host is None:
        return True
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    host = str(host).strip("[]").split("%")[0]
    if host.lower() in LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_allowed(event: str, args: tuple) -> bool:
    if event == "socket.connect":
        sock, address = args
        if getattr(sock, "family", None) == socket.AF_UNIX or isinstance(address, (str, bytes)):
            return True
        return _is_loopback_host(address[0])
    if event == "socket.getaddrinfo":
        return _is_loopback_host(args[0])
    if event == "socket.gethostbyname":
        return _is_loopback_host(args[0])
    return True


def _record(event: str, args: tuple) -> None:
    path = os.environ.get(LOG_ENV)
    target = args[-1] if event == "socket.connect" else args[0]
    line = f"pid={os.getpid()} argv={' '.join(sys.argv)[:200]} {event} {target!r}\n"
    stack = "".join(traceback.format_stack(limit=12))
    if path:
        with open(path, "a") as fh:
            fh.write(line + stack + "\n")


def _hook(event: str, args: tuple) -> None:
    if event in ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname") and not is_allowed(event, args):
        _record(event, args)
        raise NetworkRefused(f"netguard: non-loopback network access refused ({event})")


_installed = False


def install() -> None:
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
