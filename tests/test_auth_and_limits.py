"""OIDC access tokens against a local fake provider, and per-user rate limits."""

import time

import pytest

from memories.models import ExternalIdentity, RateWindow

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def test_valid_access_token_maps_sub_to_a_user_and_azp_to_the_client(api_client, oidc):
    token = oidc.token(sub="user-123", aud="memsite", azp="claude-desktop", email="dana@example.com")
    client = api_client(token)
    created = client.post("/v1/memories", {"memory": "Dana likes jazz"}, format="json")
    assert created.status_code == 201, created.json()

    identity = ExternalIdentity.objects.get(subject="user-123")
    assert identity.issuer == oidc.issuer and identity.user.email == "dana@example.com"
    listed = client.get("/v1/memories").json()["memories"]
    assert [(m["memory"], m["client_app"]) for m in listed] == [("Dana likes jazz", "claude-desktop")]

    # Same subject, new token: same user, same memories.
    again = api_client(oidc.token(sub="user-123", aud="memsite")).get("/v1/memories").json()["memories"]
    assert [m["id"] for m in again] == [m["id"] for m in listed]
    assert ExternalIdentity.objects.count() == 1


def test_bad_tokens_are_refused(api_client, oidc):
    from cryptography.hazmat.primitives.asymmetric import rsa

    other_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    bad_tokens = {
        "wrong audience": oidc.token(sub="u", aud="someone-else"),
        "wrong issuer": oidc.token(sub="u", aud="memsite", iss="http://127.0.0.1:1/evil"),
        "expired": oidc.token(sub="u", aud="memsite", exp=int(time.time()) - 3600),
        "bad signature": oidc.token(sub="u", aud="memsite", key=other_key),
        "unknown key id": oidc.token(sub="u", aud="memsite", kid="rotated-away"),
        "no subject": oidc.token(aud="memsite"),
        "garbage": "eyJhbGciOi.not.a.jwt",
    }
    for reason, token in bad_tokens.items():
        response = api_client(token).get("/v1/memories")
        assert response.status_code == 401, reason
    assert ExternalIdentity.objects.count() == 0


def test_oidc_is_off_unless_configured(api_client, settings):
    settings.OIDC_ISSUER = None
    assert api_client("eyJhbGciOiJSUzI1NiJ9.e30.sig").get("/v1/memories").status_code == 401


def test_rate_limit_answers_429_with_retry_after(api_client, alice_key, settings):
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "search_memory": (3, 60)}
    client = api_client(alice_key)
    for _ in range(3):
        assert client.post("/v1/memories/search", {"query": "q"}, format="json").status_code == 200
    limited = client.post("/v1/memories/search", {"query": "q"}, format="json")
    assert limited.status_code == 429
    assert limited.json()["error"]["code"] == "rate_limited"
    assert 1 <= int(limited["Retry-After"]) <= 60
    assert limited.json()["error"]["retry_after_s"] == int(limited["Retry-After"])
    # Other operations and other users have their own windows.
    assert client.get("/v1/memories").status_code == 200


def test_zero_disables_a_limit(api_client, alice_key, settings):
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "list_memory": (0, 60)}
    client = api_client(alice_key)
    for _ in range(5):
        assert client.get("/v1/memories").status_code == 200
    assert not RateWindow.objects.filter(operation="list_memory").exists()


def test_rate_limit_settings_from_environment():
    import subprocess
    import sys

    from tests.environment import ROOT

    code = "from django.conf import settings; import django; django.setup(); print(settings.RATE_LIMITS['remember'])"
    env = {"DJANGO_SETTINGS_MODULE": "memsite.settings", "RATE_LIMIT_REMEMBER": "7/hour", "PATH": "/usr/bin"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.stdout.strip() == "(7, 3600)", result.stderr
    env["RATE_LIMIT_REMEMBER"] = "lots"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert "RATE_LIMIT_REMEMBER must look like" in result.stderr
