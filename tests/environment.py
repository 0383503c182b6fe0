"""Loaded by pytest with `-p tests.environment`, before Django's settings are read.

- Points the suite at its own data dir (var/test) and embedded Postgres, started here
  for the session (or any Postgres given by DATABASE_URL).
- Under pytest-xdist (bin/test runs one worker per core) each worker has its own data dir
  (var/test/gw0...), embedded Postgres and test database; the controller starts none.
- Installs the network guard in this process and, through PYTHONPATH, in every
  subprocess; the session fails if anything tried to leave the machine.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NETGUARD_DIR = Path(__file__).resolve().parent / "netguard"
BASE_TEST_DATA_DIR = Path(os.environ.get("MEMSITE_TEST_DATA_DIR", ROOT / "var" / "test"))
# xdist sets this in each worker before plugins load; pytest-django suffixes the test
# database's name with it the same way, and subprocesses of ours must find that database.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
TEST_DATA_DIR = BASE_TEST_DATA_DIR / WORKER if WORKER else BASE_TEST_DATA_DIR
TEST_DATABASE = f"test_memsite_{WORKER}" if WORKER else "test_memsite"

os.environ["MEMSITE_ENV"] = "test"
# The fake upstreams a key is pointed at listen on 127.0.0.1 (a key's own upstream is
# otherwise public addresses only; tests/test_proxy_bad_input.py checks that with it off).
os.environ["PROXY_KEY_UPSTREAM_ALLOW_LOOPBACK"] = "true"
os.environ["MEMSITE_DATA_DIR"] = str(TEST_DATA_DIR)
for name in ("GOOGLE_API_KEY", "LLM_BASE_URL", "LLM_API_KEY", "LLM_MODEL", "EMBEDDER", "CELERY_BROKER_URL"):
    os.environ.pop(name, None)
TEST_DATA_DIR.mkdir(parents=True, exist_ok=True)

NETGUARD_LOG = TEST_DATA_DIR / "netguard.log"
NETGUARD_LOG.unlink(missing_ok=True)
os.environ["MEMSITE_NETGUARD_LOG"] = str(NETGUARD_LOG)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(NETGUARD_DIR), str(ROOT), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(NETGUARD_DIR))
import netguard  # noqa: E402

netguard.install()

_postgres = None


def _test_broker_url() -> str:
    from memsite.dbconf import sqlalchemy_url
    from memsite.settings import DATABASES

    return sqlalchemy_url({**DATABASES["default"], "NAME": TEST_DATABASE}, scheme="sqla+postgresql+psycopg")


def _is_xdist_controller(config) -> bool:
    return not WORKER and getattr(config.option, "dist", "no") != "no"


def pytest_configure(config):
    global _postgres
    if _is_xdist_controller(config):
        # Only the workers run tests. Each clears its own log when it starts; this clears
        # those an earlier run's workers left that this run may not start.
        for log in BASE_TEST_DATA_DIR.glob("gw*/netguard.log"):
            log.unlink()
        return
    if not os.environ.get("DATABASE_URL"):
        from memsite.embedded_pg import EmbeddedPostgres

        _postgres = EmbeddedPostgres(TEST_DATA_DIR)
        if not _postgres.try_lock():
            raise RuntimeError(f"another test session uses {TEST_DATA_DIR}")
        _postgres.start()
    # The broker lives in the test database, so workers started by tests share it.
    os.environ["CELERY_BROKER_URL"] = _test_broker_url()
    from django.conf import settings

    settings.CELERY_BROKER_URL = os.environ["CELERY_BROKER_URL"]


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    logs = [NETGUARD_LOG]
    if _is_xdist_controller(session.config):
        # Each worker logs in its own data dir, and a worker's exit status does not decide
        # the run's: the controller reads them all.
        logs += sorted(BASE_TEST_DATA_DIR.glob("gw*/netguard.log"))
    attempts = "".join(log.read_text() for log in logs if log.exists())
    if attempts.strip():
        sys.stderr.write("\nnetguard: non-loopback network access was attempted:\n" + attempts)
        session.exitstatus = 1


def pytest_unconfigure(config):  # noqa: ARG001
    if _postgres is not None:
        _postgres.stop()
        _postgres.release_lock()
