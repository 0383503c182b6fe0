"""The OAuth endpoints honour ALLOWED_HOSTS. The SDK's /oauth/authorize, /token, /register
and /revoke are mounted beside Django, so Django's host check never ran: with
PUBLIC_BASE_URL unset a foreign Host became the issuer, the consent redirect's host and
the stored resource. A foreign Host is now refused with the OAuth error shape and the
status the MCP endpoints give it (421 Misdirected Request, RFC 9110 §15.5.20), and
nothing is stored."""

from __future__ import annotations

import json
from urllib.parse import urlencode

import pytest

from oauth import services
from oauth.models import OAuthAuthorizationRequest, OAuthClient, OAuthCode, OAuthGrant, OAuthToken
from tests.conftest import internal_call
from tests.oauth_helpers import oauth_in_process, pkce, query_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

CALLBACK = "http://127.0.0.1:5555/cb"
EVIL = {"Host": "evil.example"}


def _assert_refused_host(response) -> None:
    assert response.status_code == 421, response.text
    assert response.json()["error"] == "invalid_request", response.text
    assert "ALLOWED_HOSTS" in response.json()["error_description"]
    assert "location" not in response.headers


def _register(headers: dict | None = None) -> tuple[str, str, dict]:
    body = {"client_name": "Host test", "redirect_uris": [CALLBACK], "token_endpoint_auth_method": "none"}
    return (
        "POST",
        "/oauth/register",
        {"content": json.dumps(body), "headers": {"Content-Type": "application/json", **(headers or {})}},
    )


def test_register_and_authorize_refuse_a_foreign_host_and_store_nothing():
    (refused_registration,) = oauth_in_process(_register(EVIL))
    _assert_refused_host(refused_registration)
    assert not OAuthClient.objects.exists()

    (registered,) = oauth_in_process(_register())
    assert registered.status_code == 201, registered.text
    _, challenge = pkce()
    query = urlencode(
        {"client_id": registered.json()["client_id"], "response_type": "code", "code_challenge": challenge}
    )
    foreign, port_only, allowed = oauth_in_process(
        ("GET", f"/oauth/authorize?{query}", {"headers": EVIL}),
        ("GET", f"/oauth/authorize?{query}", {"headers": {"Host": ":80"}}),
        ("GET", f"/oauth/authorize?{query}", {}),
    )
    _assert_refused_host(foreign)
    _assert_refused_host(port_only)
    assert allowed.status_code == 302, allowed.text
    assert allowed.headers["location"].startswith("http://testserver/oauth/consent/")
    assert list(OAuthAuthorizationRequest.objects.values_list("resource", flat=True)) == [
        "http://testserver/engines/memory/mcp"
    ]


def test_token_and_revoke_refuse_a_foreign_host_and_leave_the_code_usable(alice):
    client = OAuthClient.objects.create(
        client_id="host-client", kind=OAuthClient.Kind.DCR, redirect_uris=[CALLBACK], token_endpoint_auth_method="none"
    )
    verifier, challenge = pkce()
    key = services.oauth_authorization_begin(
        client=client, redirect_uri=CALLBACK, redirect_uri_explicit=True, state="s", scopes=["read"],
        code_challenge=challenge, resource="http://testserver/engines/memory/mcp",
    )  # fmt: skip
    redirect = services.oauth_consent_decide(
        request_key=key, user=alice, granted=["read"], issuer="http://testserver", call=internal_call()
    )
    form = {
        "grant_type": "authorization_code", "code": query_of(redirect)["code"], "redirect_uri": CALLBACK,
        "client_id": client.client_id, "code_verifier": verifier,
    }  # fmt: skip
    foreign_token, foreign_revoke = oauth_in_process(
        ("POST", "/oauth/token", {"data": form, "headers": EVIL}),
        ("POST", "/oauth/revoke", {"data": {"token": "mso_at_x", "client_id": client.client_id}, "headers": EVIL}),
    )
    _assert_refused_host(foreign_token)
    _assert_refused_host(foreign_revoke)
    assert OAuthCode.objects.get().used_at is None
    assert OAuthGrant.objects.get().revoked_at is None
    assert not OAuthToken.objects.exists()

    (token,) = oauth_in_process(("POST", "/oauth/token", {"data": form}))
    assert token.status_code == 200, token.text
    assert token.json()["access_token"].startswith("mso_at_")


def test_a_wildcard_in_allowed_hosts_is_honoured(settings):
    settings.ALLOWED_HOSTS = [".example.com"]
    subdomain, other = oauth_in_process(
        _register({"Host": "auth.example.com:8443"}),
        _register({"Host": "example.org"}),
    )
    assert subdomain.status_code == 201, subdomain.text
    _assert_refused_host(other)


@pytest.mark.parametrize(
    "path",
    [
        "/.well-known/oauth-authorization-server",
        "/.well-known/oauth-protected-resource",
        "/.well-known/oauth-protected-resource/engines/memory/mcp",
    ],
)
def test_the_metadata_documents_answer_a_foreign_host_as_the_oauth_endpoints_do(client, path):
    """Served by Django, whose host check answered its HTML 400 page to OAuth clients that
    parse JSON. Now the OAuth endpoints' answer, never a document naming the foreign host
    as issuer or resource, never the host echoed."""
    refused = client.get(path, HTTP_HOST="evil.example")
    _assert_refused_host(refused)
    assert refused["Cache-Control"] == "no-store"
    assert b"evil.example" not in refused.content
    allowed = client.get(path)
    assert allowed.status_code == 200 and "http://testserver" in allowed.content.decode()


FOREIGN = "evil.example<script>"


def test_every_json_surface_answers_a_foreign_host_421_in_its_own_shape(settings):
    """Through the whole ASGI application, as served: the MCP and OAuth apps beside Django,
    and Django's JSON surfaces (metadata, REST, the chat proxy, the health check), one
    status for the same mistake; the host is never echoed. Web pages keep Django's page."""
    import asyncio

    import httpx2

    from memsite.asgi import build_application

    settings.ALLOWED_HOSTS = ["memory.example.com"]
    requests = {
        "mcp": ("POST", "/engines/memory/mcp"),
        "authorize": ("GET", "/oauth/authorize"),
        "token": ("POST", "/oauth/token"),
        "register": ("POST", "/oauth/register"),
        "revoke": ("POST", "/oauth/revoke"),
        "as metadata": ("GET", "/.well-known/oauth-authorization-server"),
        "pr metadata": ("GET", "/.well-known/oauth-protected-resource"),
        "toolset metadata": ("GET", "/.well-known/oauth-protected-resource/engines/memory-toolkit/mcp"),
        "rest": ("GET", "/v1/memories"),
        "rest post": ("POST", "/v1/memories"),
        "rest export": ("GET", "/v1/memories/export"),
        "seed 001": ("POST", "/v1/memory/search"),
        "schema": ("GET", "/v1/schema/"),
        "chat proxy": ("POST", "/v1/chat/completions"),
        "proxy tokens": ("GET", "/v1/admin/tokens"),
        "no such toolset": ("POST", "/engines/nope/mcp"),
        "healthz": ("GET", "/healthz"),
        "web page": ("GET", "/accounts/login/"),
        "consent page": ("GET", "/oauth/apps/"),
    }

    async def main():
        transport = httpx2.ASGITransport(app=build_application())
        async with httpx2.AsyncClient(transport=transport, base_url="http://memory.example.com", timeout=60) as http:
            answers = {}
            for label, (method, path) in requests.items():
                answers[label] = await http.request(method, path, headers={"Host": FOREIGN})
            answers["allowed"] = await http.get("/.well-known/oauth-authorization-server")
            return answers

    answers = asyncio.run(main())
    for label, answer in answers.items():
        assert b"evil.example" not in answer.content, label
    assert answers.pop("allowed").status_code == 200
    for label in ("web page", "consent page"):
        page = answers.pop(label)
        assert page.status_code == 400 and page.headers["content-type"].startswith("text/html"), label
    for label, answer in answers.items():
        assert answer.status_code == 421, (label, answer.status_code, answer.text[:200])
        assert answer.headers["content-type"] == "application/json", label
        assert "ALLOWED_HOSTS" in answer.text, label
    assert answers["mcp"].json()["error"]["data"]["code"] == "forbidden"
    for label in ("authorize", "token", "register", "revoke", "as metadata", "pr metadata", "toolset metadata"):
        assert answers[label].json()["error"] == "invalid_request", label
    for label in ("rest", "rest post", "rest export", "seed 001", "schema", "chat proxy", "proxy tokens"):
        assert answers[label].json()["error"]["code"] == "forbidden", label
    for label in ("no such toolset", "healthz"):
        assert answers[label].json()["error"]["code"] == "forbidden", label
