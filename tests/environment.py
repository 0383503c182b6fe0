"""Loaded by pytest with `-p tests.environment`, before Django's settings are read.

- Points the suite at its own data dir (var/test) and embedded Postgres, started here
  for the session (or any Postgres given by DATABASE_URL).
- Installs the network guard in this process and, through PYTHONPATH, in every
  subprocess; the session fails if anything tried to leave the machine.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NETGUARD_DIR = Path(__file__).resolve().parent / "netguard"
TEST_DATA_DIR = Path(os.environ.get("MEMSITE_TEST_DATA_DIR", ROOT / "var" / "test"))
TEST_DATABASE = "test_memsite"

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


def pytest_configure(config):  # noqa: ARG001
    global _postgres
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
    if NETGUARD_LOG.exists() and NETGUARD_LOG.read_text().strip():
        sys.stderr.write("\nnetguard: non-loopback network access was attempted:\n" + NETGUARD_LOG.read_text())
        session.exitstatus = 1


def pytest_unconfigure(config):  # noqa: ARG001
    if _postgres is not None:
        _postgres.stop()
        _postgres.release_lock()
