import json
import subprocess
import sys

import pytest

from memsite import env
from tests.environment import ROOT


def test_typed_helpers(monkeypatch):
    monkeypatch.setenv("X_INT", "12")
    monkeypatch.setenv("X_BOOL", "off")
    monkeypatch.setenv("X_LIST", "a, b,,c")
    assert env.env_int("X_INT", 1) == 12
    assert env.env_bool("X_BOOL", True) is False
    assert env.env_list("X_LIST", []) == ["a", "b", "c"]
    assert env.env_int("X_MISSING", 7) == 7


@pytest.mark.parametrize(
    ("helper", "value"),
    [(lambda: env.env_int("X", 1), "twelve"), (lambda: env.env_bool("X", True), "maybe"),
     (lambda: env.env_int("X", 1, minimum=1), "0"), (lambda: env.env_float("X", 1.0), "fast"),
     (lambda: env.env_choice("X", "a", ("a", "b")), "c")],
)  # fmt: skip
def test_bad_values_fail_loudly(monkeypatch, helper, value):
    monkeypatch.setenv("X", value)
    with pytest.raises(env.ConfigError, match="X must"):
        helper()


def _import_settings(**overrides):
    import os

    child_env = {**os.environ, **overrides}
    return subprocess.run(
        [sys.executable, "-c", "import memsite.settings"], cwd=ROOT, env=child_env, capture_output=True, text=True
    )


def test_production_needs_a_secret_key():
    result = _import_settings(MEMSITE_ENV="production", DJANGO_SECRET_KEY="")
    assert result.returncode != 0
    assert "DJANGO_SECRET_KEY must be set" in result.stderr


def test_production_needs_an_audit_master_key():
    result = _import_settings(MEMSITE_ENV="production", DJANGO_SECRET_KEY="x" * 50, AUDIT_MASTER_KEY="")
    assert result.returncode != 0
    assert "AUDIT_MASTER_KEY must be set" in result.stderr


@pytest.mark.parametrize("value", ["not base64!", "c2hvcnQ=", "A" * 60])
def test_a_bad_audit_master_key_is_refused(value):
    result = _import_settings(AUDIT_MASTER_KEY=value)
    assert result.returncode != 0
    assert "AUDIT_MASTER_KEY must be 32 random bytes" in result.stderr
    assert value not in result.stderr  # the secret itself is never echoed


def test_bad_port_is_refused():
    result = _import_settings(PORT="eighty")
    assert result.returncode != 0
    assert "PORT must be an integer" in result.stderr


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("PORT", "70000", "PORT must be <= 65535"),
        ("IMPORT_MAX_BYTES", "-1", "IMPORT_MAX_BYTES must be >= 1"),
        ("DECISION_MAX_PER_USER", "0", "DECISION_MAX_PER_USER must be >= 1"),
        ("OAUTH_ACCESS_TOKEN_TTL_S", "0", "OAUTH_ACCESS_TOKEN_TTL_S must be >= 1"),
        ("OIDC_TENANT_MAP", "acme", "OIDC_TENANT_MAP must look like key:value"),
        ("LOGIN_FAILURES_PER_USERNAME", "0", "LOGIN_FAILURES_PER_USERNAME must be >= 1"),
        ("LOGIN_FAILURE_WINDOW_S", "86401", "LOGIN_FAILURE_WINDOW_S must be <= 86400"),
        ("SECURE_HSTS_SECONDS", "-1", "SECURE_HSTS_SECONDS must be >= 0"),
        ("SECURE_PROXY_SSL_HEADER", "X-Forwarded-Proto: https", "SECURE_PROXY_SSL_HEADER must be a header name"),
        ("SECURE_HSTS_PRELOAD", "true", "SECURE_HSTS_PRELOAD needs SECURE_HSTS_INCLUDE_SUBDOMAINS"),
        ("DATABASE_URL", "postgres://user:s3cretPW@host:notaport/db", "DATABASE_URL is not a valid postgresql:// URL"),
    ],
)
def test_out_of_range_or_malformed_values_stop_the_start(name, value, message):
    result = _import_settings(**{name: value})
    assert result.returncode != 0
    assert message in result.stderr
    assert "s3cretPW" not in result.stderr


def test_gemini_embedder_needs_a_key():
    result = _import_settings(EMBEDDER="gemini")
    assert "EMBEDDER=gemini needs GOOGLE_API_KEY" in result.stderr


def test_the_coverage_gate_must_open_above_where_it_closes():
    result = _import_settings(SEARCH_COVERAGE_UNRELATED_COSINE="0.3", SEARCH_COVERAGE_RELATED_COSINE="0.1")
    assert result.returncode != 0
    assert "SEARCH_COVERAGE_RELATED_COSINE must be >= 0.3" in result.stderr
    step = _import_settings(SEARCH_COVERAGE_UNRELATED_COSINE="0.2", SEARCH_COVERAGE_RELATED_COSINE="0.2")
    assert step.returncode == 0, step.stderr  # equal: a step instead of a ramp


PRODUCTION = {"MEMSITE_ENV": "production", "DJANGO_SECRET_KEY": "x" * 50, "AUDIT_MASTER_KEY": "A" * 43 + "="}
HTTPS_SETTINGS = (
    "SECURE_HSTS_SECONDS",
    "SECURE_HSTS_INCLUDE_SUBDOMAINS",
    "SECURE_HSTS_PRELOAD",
    "SECURE_PROXY_SSL_HEADER",
)


def _settings_of(**overrides) -> dict:
    """The HTTPS settings a process started with these variables gets."""
    import os

    code = f"import json, memsite.settings as s; print(json.dumps({{n: getattr(s, n) for n in {HTTPS_SETTINGS!r}}}))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **overrides}, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_production_sends_hsts_for_a_year_and_it_can_be_turned_off():
    assert _settings_of(**PRODUCTION) == {
        "SECURE_HSTS_SECONDS": 31_536_000,
        "SECURE_HSTS_INCLUDE_SUBDOMAINS": False,
        "SECURE_HSTS_PRELOAD": False,
        "SECURE_PROXY_SSL_HEADER": None,  # uvicorn takes X-Forwarded-Proto from a trusted proxy
    }
    assert _settings_of(**PRODUCTION, SECURE_HSTS_SECONDS="0")["SECURE_HSTS_SECONDS"] == 0
    assert _settings_of(MEMSITE_ENV="local")["SECURE_HSTS_SECONDS"] == 0  # plain http locally
    chosen = _settings_of(
        **PRODUCTION,
        SECURE_HSTS_SECONDS="63072000",
        SECURE_HSTS_INCLUDE_SUBDOMAINS="true",
        SECURE_HSTS_PRELOAD="true",
        SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto",
    )
    assert chosen == {
        "SECURE_HSTS_SECONDS": 63_072_000,
        "SECURE_HSTS_INCLUDE_SUBDOMAINS": True,
        "SECURE_HSTS_PRELOAD": True,
        "SECURE_PROXY_SSL_HEADER": ["HTTP_X_FORWARDED_PROTO", "https"],
    }


@pytest.mark.django_db
def test_hsts_goes_out_on_https_responses_only(client, settings):
    settings.SECURE_HSTS_SECONDS = 31_536_000
    assert client.get("/accounts/login/", secure=True)["Strict-Transport-Security"] == "max-age=31536000"
    assert "Strict-Transport-Security" not in client.get("/accounts/login/")
    # Behind a proxy named in SECURE_PROXY_SSL_HEADER, its header says the request was https.
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    proxied = client.get("/accounts/login/", HTTP_X_FORWARDED_PROTO="https")
    assert proxied["Strict-Transport-Security"] == "max-age=31536000"
