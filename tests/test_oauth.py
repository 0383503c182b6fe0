"""MCP authorization (issue 16): the SDK's OAuthClientProvider against the running service
(discovery from a bare 401, CIMD and DCR registration, PKCE with a scripted user, tokens,
tool calls in both protocol modes), rotation, audience binding, permissions, revocation,
RFC error codes, and tenancy."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from audit.models import AuditEvent
from core.choices import Operation
from oauth.models import OAuthAuthorizationRequest, OAuthClient, OAuthGrant
from oauth.services import redirect_uri_check, redirect_uri_matches
from tests.oauth_helpers import (
    DocumentServer,
    ScriptedUser,
    authorize_url,
    pkce,
    query_of,
    start_memsite,
    tls_files,
    token_request,
)

CURSOR_REDIRECTS = [
    "cursor://anysphere.cursor-mcp/oauth/callback",
    "https://www.cursor.com/agents/mcp/oauth/callback",
    "http://localhost:8787/callback",
]
CALLBACK = "http://127.0.0.1:3118/callback"


@pytest.fixture(scope="module")
def oauth_live(django_db_setup, fake_llm, fake_gateway_server, tmp_path_factory):  # noqa: ARG001
    """A memsite allowed (test setting) to fetch metadata documents from an https server
    on loopback whose CA it trusts, and that server."""
    directory = tmp_path_factory.mktemp("oauth")
    ca, cert, key = tls_files(directory)
    documents = DocumentServer(cert, key)
    base, stop = start_memsite(
        directory / "web.log",
        {"OAUTH_CIMD_ALLOW_LOOPBACK": "true", "OAUTH_CIMD_CA_FILE": str(ca)},
        fake_llm,
        fake_gateway_server,
    )
    yield {"url": base, "documents": documents, "log": directory / "web.log"}
    stop()
    documents.stop()


@pytest.fixture
def live(oauth_live, transactional_db, clean_vectors):  # noqa: ARG001
    return oauth_live


def claude_document(documents: DocumentServer, path: str = "/claude/client.json", **overrides) -> str:
    url = documents.url + path
    body = {
        "client_id": url,
        "client_name": "Claude (test)",
        "client_uri": "https://claude.ai",
        # Registered without a port: loopback redirects match on any port (RFC 8252).
        "redirect_uris": ["http://127.0.0.1/callback"],
        "grant_types": ["authorization_code", "refresh_token"],
        "response_types": ["code"],
        "token_endpoint_auth_method": "none",
        **overrides,
    }
    return documents.document(path, body)


# --- the SDK client end to end -----------------------------------------------------------
class MemoryStorage:
    def __init__(self):
        self.tokens = None
        self.client_info = None

    async def get_tokens(self):
        return self.tokens

    async def set_tokens(self, tokens):
        self.tokens = tokens

    async def get_client_info(self):
        return self.client_info

    async def set_client_info(self, client_info):
        self.client_info = client_info


def sdk_session(
    base: str,
    user: ScriptedUser,
    *,
    mode: str,
    metadata_url: str | None,
    grant=None,
    storage=None,
    path: str = "/engines/memory/mcp",
    auth_method: str | None = "none",
):
    """Run `work(client)` in an MCP session authorized by OAuthClientProvider; a dynamic
    registration asks for `auth_method` (None: names none)."""
    import httpx2
    from mcp import Client
    from mcp.client.auth import AuthorizationCodeResult, OAuthClientProvider
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared.auth import OAuthClientMetadata

    answers: list[str] = []
    storage = storage or MemoryStorage()

    async def redirect_handler(url: str) -> None:
        answers.append(user.authorize(url, grant=grant))  # the scripted user signs in and consents

    async def callback_handler() -> AuthorizationCodeResult:
        params = query_of(answers[-1])
        return AuthorizationCodeResult(code=params["code"], state=params.get("state"), iss=params.get("iss"))

    provider = OAuthClientProvider(
        server_url=f"{base}{path}",
        client_metadata=OAuthClientMetadata(
            client_name="SDK test client",
            redirect_uris=[CALLBACK],
            grant_types=["authorization_code", "refresh_token"],
            response_types=["code"],
            token_endpoint_auth_method=auth_method,
        ),
        storage=storage,
        redirect_handler=redirect_handler,
        callback_handler=callback_handler,
        client_metadata_url=metadata_url,
    )

    def run(work):
        async def session():
            async with httpx2.AsyncClient(auth=provider, timeout=60) as http:
                transport = streamable_http_client(f"{base}{path}", http_client=http)
                async with Client(transport, mode=mode) as client:
                    return await work(client)

        try:
            return asyncio.run(session())
        except BaseExceptionGroup as group:
            while isinstance(group, BaseExceptionGroup) and len(group.exceptions) == 1:
                group = group.exceptions[0]
            raise group from None

    return run, storage, answers


async def _remember_and_search(client):
    stored = await client.call_tool("remember", {"memory": "I keep my bike in the blue shed"})
    found = await client.call_tool("search_memory", {"query": "where is the bike"})
    return stored, found


@pytest.mark.parametrize("mode", ["legacy", "auto"])
def test_cimd_client_discovers_signs_in_and_calls_tools(live, alice, mode):
    base = live["url"]
    # A bare 401 names the resource metadata and the scopes.
    bare = httpx.post(f"{base}/engines/memory/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
    assert bare.status_code == 401
    assert 'resource_metadata="' in bare.headers["WWW-Authenticate"]
    assert 'scope="read write delete"' in bare.headers["WWW-Authenticate"]
    metadata = httpx.get(f"{base}/.well-known/oauth-authorization-server").json()
    assert metadata["issuer"] == base
    assert metadata["client_id_metadata_document_supported"] is True
    assert metadata["code_challenge_methods_supported"] == ["S256"]
    assert "none" in metadata["token_endpoint_auth_methods_supported"]
    assert metadata["authorization_response_iss_parameter_supported"] is True
    assert httpx.get(f"{base}/.well-known/oauth-protected-resource").json()["authorization_servers"] == [base]

    document_url = claude_document(live["documents"])
    user = ScriptedUser(base, "alice", "alice-password-1")
    run, storage, answers = sdk_session(base, user, mode=mode, metadata_url=document_url)
    stored, found = run(_remember_and_search)
    assert not stored.is_error and not found.is_error, (stored.structured_content, found.structured_content)
    assert [r["memory"] for r in found.structured_content["results"]] == ["I keep my bike in the blue shed"]
    # The consent page named the client and its host; the redirect carried iss (RFC 9207).
    assert "Claude (test)" in user.consent_pages[-1] and "127.0.0.1" in user.consent_pages[-1]
    assert query_of(answers[-1])["iss"] == base
    assert storage.client_info.client_id == document_url
    assert storage.tokens.refresh_token  # offline_access was asked for and granted
    assert storage.tokens.expires_in == 3600
    # Tokens resolve to alice: her audit rows, client app = the OAuth client.
    grant = OAuthGrant.objects.get(user=alice)
    assert grant.client.kind == "cimd" and grant.resource == f"{base}/engines/memory/mcp"
    assert grant.last_used_at is not None
    row = AuditEvent.objects.filter(operation=Operation.REMEMBER).latest("pk")
    assert (row.actor_user_id, row.actor_auth, row.actor_client_app) == (alice.pk, "oauth", "oauth:Claude (test)")
    audited = set(AuditEvent.objects.filter(operation__startswith="oauth_").values_list("operation", flat=True))
    assert {"oauth_client_register", "oauth_consent", "oauth_token"} <= audited


def test_dcr_client_signs_in_and_registration_is_deduplicated(live, alice):
    base = live["url"]
    user = ScriptedUser(base, "alice", "alice-password-1")
    run, storage, _ = sdk_session(base, user, mode="auto", metadata_url=None)
    stored, found = run(_remember_and_search)
    assert not stored.is_error and found.structured_content["results"]
    assert OAuthClient.objects.get(client_id=storage.client_info.client_id).kind == "dcr"

    # Cursor's registration, its three redirect URIs, twice: one client.
    body = {
        "client_name": "Cursor",
        "redirect_uris": CURSOR_REDIRECTS,
        "grant_types": ["authorization_code", "refresh_token"],
        "response_types": ["code"],
        "token_endpoint_auth_method": "none",
    }
    first = httpx.post(f"{base}/oauth/register", json=body)
    second = httpx.post(f"{base}/oauth/register", json=body)
    assert first.status_code == second.status_code == 201, first.text
    assert first.json()["client_id"] == second.json()["client_id"]
    assert OAuthClient.objects.filter(client_name="Cursor").count() == 1
    # Each of the three redirects works for an authorization request.
    for redirect in CURSOR_REDIRECTS:
        _, challenge = pkce()
        url = authorize_url(
            base, response_type="code", client_id=first.json()["client_id"], redirect_uri=redirect,
            code_challenge=challenge, code_challenge_method="S256", state="s",
        )  # fmt: skip
        answer = httpx.get(url)
        assert answer.status_code == 302 and "/oauth/consent/" in answer.headers["location"], answer.text


@pytest.mark.parametrize("path", ["/engines/memory-toolkit/mcp", "/engines/memory-lifecycle/mcp"])
def test_sdk_client_signs_in_to_the_other_toolsets_from_their_own_401(live, alice, path):
    """Each toolset is its own protected resource (RFC 9728): its 401 names its own
    metadata, so the client asks for (and gets) a token for the endpoint it called."""
    base = live["url"]
    bare = httpx.post(f"{base}{path}", json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
    assert f'resource_metadata="{base}/.well-known/oauth-protected-resource{path}"' in bare.headers["WWW-Authenticate"]
    user = ScriptedUser(base, "alice", "alice-password-1")
    run, _, _ = sdk_session(base, user, mode="legacy", metadata_url=None, path=path)
    from memories.interfaces.mcp.registry import TOOLSETS

    tools = run(lambda client: client.list_tools()).tools
    assert {tool.name for tool in tools} == {tool.name for t in TOOLSETS if t.path == path for tool in t.tools}
    assert OAuthGrant.objects.get(user=alice).resource == f"{base}{path}"


# --- raw flows ---------------------------------------------------------------------------
def dcr_client(base: str, redirect: str = CALLBACK) -> str:
    answer = httpx.post(
        f"{base}/oauth/register",
        json={"client_name": "Raw client", "redirect_uris": [redirect], "token_endpoint_auth_method": "none"},
    )
    assert answer.status_code == 201, answer.text
    return answer.json()["client_id"]


def tokens_for(
    base: str,
    user: ScriptedUser,
    client_id: str,
    *,
    grant=None,
    resource=None,
    scope=None,
    secret: dict | None = None,
    auth: httpx.BasicAuth | None = None,
) -> dict:
    """The tokens of a fresh grant: `secret` ({"client_secret": ...}) or `auth` (Basic)
    authenticate a confidential client at /token."""
    verifier, challenge = pkce()
    params = {
        "response_type": "code", "client_id": client_id, "redirect_uri": CALLBACK, "state": "st",
        "code_challenge": challenge, "code_challenge_method": "S256",
        "resource": resource or f"{base}/engines/memory/mcp",
    }  # fmt: skip
    if scope:
        params["scope"] = scope
    redirect = user.authorize(authorize_url(base, **params), grant=grant)
    code = query_of(redirect)["code"]
    form = {
        "grant_type": "authorization_code", "code": code, "redirect_uri": CALLBACK, "client_id": client_id,
        "code_verifier": verifier, **(secret or {}),
    }  # fmt: skip
    answer = httpx.post(f"{base}/oauth/token", data=form, auth=auth, timeout=30)
    assert answer.status_code == 200, answer.text
    return {**answer.json(), "code": code, "verifier": verifier}


def revoke_request(base: str, *, auth: httpx.BasicAuth | None = None, **form: str) -> httpx.Response:
    return httpx.post(f"{base}/oauth/revoke", data=form, auth=auth, timeout=30)


def tool_error_code(response: httpx.Response) -> str:
    """The code of a tool error result: in its text (error results carry no structuredContent)."""
    result = response.json()["result"]
    assert result["isError"] is True and "structuredContent" not in result, result
    return json.loads(result["content"][0]["text"])["error"]["code"]


def mcp_call(base: str, token: str, name: str, arguments: dict) -> httpx.Response:
    return httpx.post(
        f"{base}/engines/memory/mcp",
        headers={"Authorization": f"Bearer {token}", "Accept": "application/json, text/event-stream"},
        json={"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name, "arguments": arguments}},
        timeout=60,
    )


def test_refresh_rotation_refuses_a_used_refresh_token(live, alice):
    base = live["url"]
    user = ScriptedUser(base, "alice", "alice-password-1")
    client_id = dcr_client(base)
    first = tokens_for(base, user, client_id, scope="read write delete offline_access")
    rotated = token_request(base, grant_type="refresh_token", refresh_token=first["refresh_token"], client_id=client_id)
    assert rotated.status_code == 200, rotated.text
    assert rotated.json()["refresh_token"] != first["refresh_token"]
    assert mcp_call(base, rotated.json()["access_token"], "list_memory", {}).status_code == 200

    replay = token_request(base, grant_type="refresh_token", refresh_token=first["refresh_token"], client_id=client_id)
    assert replay.status_code == 400 and replay.json()["error"] == "invalid_grant"
    # The replay revoked the grant: the tokens issued from it stop working too.
    assert mcp_call(base, rotated.json()["access_token"], "list_memory", {}).status_code == 401
    assert OAuthGrant.objects.get(user=alice).revoked_reason == "refresh_reuse"
    assert AuditEvent.objects.filter(operation=Operation.OAUTH_REVOKE, outcome="denied").exists()


def test_token_for_another_resource_is_refused(live, alice):  # noqa: ARG001
    base = live["url"]
    user = ScriptedUser(base, "alice", "alice-password-1")
    client_id = dcr_client(base)
    other = tokens_for(base, user, client_id, resource=f"{base}/engines/other/mcp")
    assert mcp_call(base, other["access_token"], "list_memory", {}).status_code == 401
    # A resource that is not ours at all is refused at /authorize (RFC 8707 invalid_target).
    _, challenge = pkce()
    answer = httpx.get(
        authorize_url(
            base,
            response_type="code",
            client_id=client_id,
            redirect_uri=CALLBACK,
            state="x",
            code_challenge=challenge,
            resource="https://evil.example/mcp",
        )  # fmt: skip
    )
    # Answered directly, not redirected: before consent a redirect vouches for nothing.
    assert answer.status_code == 400 and answer.json()["error"] == "invalid_target", answer.text
    # Nor do OAuth tokens open the REST API (bound to the MCP resource).
    rest = httpx.get(f"{base}/v1/memories", headers={"Authorization": f"Bearer {other['access_token']}"})
    assert rest.status_code == 401


def test_read_only_grant_can_search_but_not_remember(live, alice):  # noqa: ARG001
    base = live["url"]
    user = ScriptedUser(base, "alice", "alice-password-1")
    tokens = tokens_for(base, user, dcr_client(base), grant=["read"])
    assert tokens["scope"] == "read offline_access"
    searched = mcp_call(base, tokens["access_token"], "search_memory", {"query": "anything"})
    assert searched.status_code == 200 and '"isError":true' not in searched.text.replace(" ", "")
    refused = mcp_call(base, tokens["access_token"], "remember", {"memory": "should not be stored"})
    assert tool_error_code(refused) == "forbidden"
    assert AuditEvent.objects.filter(operation=Operation.REMEMBER, error_code="forbidden").exists()


def test_revoking_in_the_ui_makes_the_next_call_401(live, alice, bob, client):
    base = live["url"]
    user = ScriptedUser(base, "alice", "alice-password-1")
    tokens = tokens_for(base, user, dcr_client(base))
    assert mcp_call(base, tokens["access_token"], "list_memory", {}).status_code == 200
    grant = OAuthGrant.objects.get(user=alice)
    # Bob cannot see or revoke alice's grant: it is a missing one to him.
    client.force_login(bob)
    assert "Raw client" not in client.get("/oauth/apps/").content.decode()
    assert client.post(f"/oauth/apps/{grant.pk}/revoke/").status_code == 404
    client.force_login(alice)
    page = client.get("/oauth/apps/").content.decode()
    assert "Raw client" in page and "read, write, delete" in page
    assert client.post(f"/oauth/apps/{grant.pk}/revoke/").status_code == 302
    assert mcp_call(base, tokens["access_token"], "list_memory", {}).status_code == 401
    row = AuditEvent.objects.get(operation=Operation.OAUTH_REVOKE)
    assert (row.actor_user_id, row.channel, row.detail["reason"]) == (alice.pk, "ui", "user_revoked")


# --- bad input: RFC error codes, no state change -----------------------------------------
def test_bad_metadata_urls_redirects_and_pkce_are_refused(live, alice):  # noqa: ARG001
    base = live["url"]
    documents = live["documents"]
    _, challenge = pkce()

    def authorize(**params):
        defaults = {
            "response_type": "code", "redirect_uri": CALLBACK, "state": "s1", "code_challenge": challenge,
            "code_challenge_method": "S256",
        }  # fmt: skip
        return httpx.get(authorize_url(base, **{**defaults, **params}))

    for bad in (
        "http://127.0.0.1:9/client.json",  # plain http
        "https://10.1.2.3/client.json",  # private address
        "https://169.254.169.254/latest/meta-data",  # link-local (cloud metadata)
        documents.url + "/missing.json",  # 404
    ):
        answer = authorize(client_id=bad)
        assert answer.status_code == 400 and answer.json()["error"] == "invalid_client", (bad, answer.text)
    redirected = documents.document("/moved.json", {}, status=302, headers={"Location": "https://example.com/x"})
    assert authorize(client_id=redirected).json()["error"] == "invalid_client"
    big = documents.document("/big.json", {"client_id": documents.url + "/big.json", "pad": "x" * 10000})
    assert "too large" in authorize(client_id=big).json()["error_description"]
    assert not OAuthClient.objects.exists()

    document_url = claude_document(documents)
    not_in_document = authorize(client_id=document_url, redirect_uri="http://evil.example/callback")
    assert not_in_document.status_code == 400 and not_in_document.json()["error"] == "invalid_request"
    missing_pkce = authorize(client_id=document_url, code_challenge="")
    plain_pkce = authorize(client_id=document_url, code_challenge_method="plain")
    for answer in (missing_pkce, plain_pkce):
        # Not redirected, even to the document's redirect: anyone can publish a document.
        assert answer.status_code == 400 and "location" not in answer.headers, answer.text
        assert answer.json()["error"] == "invalid_request"
    assert not OAuthAuthorizationRequest.objects.exists()

    bad_registration = httpx.post(
        f"{base}/oauth/register",
        json={"redirect_uris": ["http://evil.example/cb"], "token_endpoint_auth_method": "none"},
    )
    assert bad_registration.status_code == 400 and bad_registration.json()["error"] == "invalid_redirect_uri"
    assert not OAuthClient.objects.filter(kind="dcr").exists()


def test_a_reused_code_is_refused_and_revokes_its_grant(live, alice):
    base = live["url"]
    user = ScriptedUser(base, "alice", "alice-password-1")
    client_id = dcr_client(base)
    tokens = tokens_for(base, user, client_id)
    again = token_request(
        base, grant_type="authorization_code", code=tokens["code"], redirect_uri=CALLBACK, client_id=client_id,
        code_verifier=tokens["verifier"],
    )  # fmt: skip
    assert again.status_code == 400 and again.json()["error"] == "invalid_grant"
    assert mcp_call(base, tokens["access_token"], "list_memory", {}).status_code == 401
    assert OAuthGrant.objects.get(user=alice).revoked_reason == "code_reuse"
    # A wrong verifier is invalid_grant too.
    fresh = tokens_for(base, user, client_id)
    assert fresh["access_token"]


def test_wrong_code_verifier_is_invalid_grant(live, alice):  # noqa: ARG001
    base = live["url"]
    user = ScriptedUser(base, "alice", "alice-password-1")
    client_id = dcr_client(base)
    _, challenge = pkce()
    redirect = user.authorize(
        authorize_url(
            base,
            response_type="code",
            client_id=client_id,
            redirect_uri=CALLBACK,
            code_challenge=challenge,
            code_challenge_method="S256",
        )  # fmt: skip
    )
    answer = token_request(
        base, grant_type="authorization_code", code=query_of(redirect)["code"], redirect_uri=CALLBACK,
        client_id=client_id, code_verifier="x" * 50,
    )  # fmt: skip
    assert answer.status_code == 400 and answer.json()["error"] == "invalid_grant"


def test_deny_redirects_access_denied_and_is_audited(live, alice):
    base = live["url"]
    user = ScriptedUser(base, "alice", "alice-password-1")
    _, challenge = pkce()
    redirect = user.authorize(
        authorize_url(
            base,
            response_type="code",
            client_id=dcr_client(base),
            redirect_uri=CALLBACK,
            code_challenge=challenge,
            code_challenge_method="S256",
            state="abc",
        ),  # fmt: skip
        deny=True,
    )
    assert query_of(redirect) == {"error": "access_denied", "state": "abc", "iss": base}
    assert not OAuthGrant.objects.exists()
    row = AuditEvent.objects.get(operation=Operation.OAUTH_CONSENT)
    assert (row.actor_user_id, row.outcome) == (alice.pk, "denied")


# --- tenancy -----------------------------------------------------------------------------
def test_alices_token_never_touches_bobs_memories(live, alice, bob, bob_key):  # noqa: ARG001
    base = live["url"]
    from core.scope import MemoryScope
    from memories.services import memory_remember
    from tests.conftest import internal_call

    bobs = memory_remember(MemoryScope.for_user(bob), memory="Bob's locker code is 4417", call=internal_call()).id
    user = ScriptedUser(base, "alice", "alice-password-1")
    token = tokens_for(base, user, dcr_client(base))["access_token"]
    found = mcp_call(base, token, "search_memory", {"query": "locker code"})
    assert "4417" not in found.text
    listed = mcp_call(base, token, "list_memory", {})
    assert "4417" not in listed.text
    for name, arguments in (
        ("update_memory", {"memory_id": bobs, "memory": "hijacked"}),
        ("delete_memory", {"memory_id": bobs}),
    ):
        answer = mcp_call(base, token, name, arguments)
        assert tool_error_code(answer) == "not_found", answer.text
    from memories.selectors import memory_get_owned

    assert memory_get_owned(MemoryScope.for_user(bob), memory_id=bobs) is not None


# --- unit rules --------------------------------------------------------------------------
def test_redirect_rules():
    for uri in CURSOR_REDIRECTS + ["https://claude.ai/api/mcp/auth_callback", "http://[::1]:5000/cb"]:
        redirect_uri_check(uri)
    from oauth.services import OAuthError

    for bad in ("http://example.com/cb", "javascript:alert(1)", "https://x.example/cb#frag", "data:text/html,x"):
        with pytest.raises(OAuthError):
            redirect_uri_check(bad)
    assert redirect_uri_matches(["http://127.0.0.1/callback"], "http://127.0.0.1:51234/callback")
    assert redirect_uri_matches(["http://localhost:8787/callback"], "http://localhost:9999/callback")
    assert not redirect_uri_matches(["http://127.0.0.1/callback"], "http://127.0.0.1:5000/other")
    assert not redirect_uri_matches(["https://a.example/cb"], "https://a.example:444/cb")


def test_confidential_dcr_client_must_present_its_secret(live, alice):  # noqa: ARG001
    base = live["url"]
    registered = httpx.post(
        f"{base}/oauth/register",
        json={
            "client_name": "Server app",
            "redirect_uris": [CALLBACK],
            "token_endpoint_auth_method": "client_secret_post",
        },
    ).json()
    assert registered["client_secret"]
    assert OAuthClient.objects.get(client_id=registered["client_id"]).secret_sha256 != registered["client_secret"]
    user = ScriptedUser(base, "alice", "alice-password-1")
    verifier, challenge = pkce()
    redirect = user.authorize(
        authorize_url(
            base,
            response_type="code",
            client_id=registered["client_id"],
            redirect_uri=CALLBACK,
            code_challenge=challenge,
            code_challenge_method="S256",
        )  # fmt: skip
    )
    form = {
        "grant_type": "authorization_code", "code": query_of(redirect)["code"], "redirect_uri": CALLBACK,
        "client_id": registered["client_id"], "code_verifier": verifier,
    }  # fmt: skip
    wrong = token_request(base, **form, client_secret="not-it")
    assert wrong.status_code == 401 and wrong.json()["error"] == "invalid_client"
    right = token_request(base, **form, client_secret=registered["client_secret"])
    assert right.status_code == 200, right.text


# --- revocation (RFC 7009) ------------------------------------------------------------------
def test_a_public_client_revokes_its_own_tokens_without_a_secret(live, alice, bob):
    """modelcontextprotocol/python-sdk#3508: the SDK's RevocationRequest required the
    client_secret key, so a public client (auth method none: Claude Code, every CIMD
    client) revoking with client_id and token only, as RFC 7009 §2.1 lets it, got 400
    invalid_request "client_secret: Field required" and its token stayed live. Its own
    tokens are revoked now; another client's (here bob's) or an unknown token is still a
    200 that revokes nothing (RFC 7009 §2.2)."""
    base = live["url"]
    alices_client = dcr_client(base)
    bobs_client = dcr_client(base, "http://127.0.0.1/callback")  # other metadata: another client
    assert alices_client != bobs_client
    alices = tokens_for(base, ScriptedUser(base, "alice", "alice-password-1"), alices_client)
    bobs = tokens_for(base, ScriptedUser(base, "bob", "bob-password-1"), bobs_client)

    for client_id, token, hint in (
        (alices_client, bobs["access_token"], None),
        (alices_client, bobs["refresh_token"], "refresh_token"),
        (alices_client, bobs["refresh_token"], None),
        (bobs_client, alices["access_token"], "access_token"),
        (alices_client, "mso_at_unknown", None),
        (alices_client, "mso_rt_unknown", "refresh_token"),
    ):
        form = {"token": token, "client_id": client_id, **({"token_type_hint": hint} if hint else {})}
        answer = revoke_request(base, **form)
        assert answer.status_code == 200, answer.text
    assert not OAuthGrant.objects.filter(revoked_at__isnull=False).exists()
    assert mcp_call(base, alices["access_token"], "list_memory", {}).status_code == 200

    answer = revoke_request(base, token=alices["access_token"], client_id=alices_client)
    assert answer.status_code == 200, answer.text
    assert answer.headers["Cache-Control"] == "no-store"
    assert mcp_call(base, alices["access_token"], "list_memory", {}).status_code == 401
    assert OAuthGrant.objects.get(user=alice).revoked_reason == "client_revoked"
    # Bob's grant, through another client, is untouched.
    assert mcp_call(base, bobs["access_token"], "list_memory", {}).status_code == 200
    assert OAuthGrant.objects.get(user=bob).revoked_at is None

    # A refresh token likewise: its grant is revoked, its access token with it.
    again = tokens_for(base, ScriptedUser(base, "alice", "alice-password-1"), alices_client)
    answer = revoke_request(
        base, token=again["refresh_token"], token_type_hint="refresh_token", client_id=alices_client
    )
    assert answer.status_code == 200, answer.text
    refreshed = token_request(
        base, grant_type="refresh_token", refresh_token=again["refresh_token"], client_id=alices_client
    )
    assert refreshed.status_code == 400 and refreshed.json()["error"] == "invalid_grant", refreshed.text
    assert mcp_call(base, again["access_token"], "list_memory", {}).status_code == 401
    assert mcp_call(base, bobs["access_token"], "list_memory", {}).status_code == 200
    rows = AuditEvent.objects.filter(operation=Operation.OAUTH_REVOKE)
    assert sorted(rows.values_list("actor_user_id", flat=True)) == [alice.pk, alice.pk]
    assert alices["access_token"] not in live["log"].read_text()


def _confidential_client(base: str, method: str) -> tuple[str, str]:
    answer = httpx.post(
        f"{base}/oauth/register",
        json={
            "client_name": f"Server app ({method})",
            "redirect_uris": [CALLBACK],
            "token_endpoint_auth_method": method,
        },
    )
    assert answer.status_code == 201, answer.text
    return answer.json()["client_id"], answer.json()["client_secret"]


def test_a_confidential_client_revokes_only_with_its_secret(live, alice):
    """A client registered with a secret that leaves it out is refused as with a wrong
    one (401 invalid_client), and its token stays live. A client_secret_basic client, whose secret is in
    the Authorization header and not the form, revokes: it was the 400 of
    modelcontextprotocol/python-sdk#3508 too."""
    base = live["url"]
    user = ScriptedUser(base, "alice", "alice-password-1")
    post_id, post_secret = _confidential_client(base, "client_secret_post")
    basic_id, basic_secret = _confidential_client(base, "client_secret_basic")
    posted = tokens_for(base, user, post_id, secret={"client_secret": post_secret})
    basic = tokens_for(base, user, basic_id, auth=httpx.BasicAuth(basic_id, basic_secret))

    # RFC 7009 §2.2.1: invalid_client, as at /token (the SDK's revocation handler said
    # unauthorized_client).
    for refused in (
        revoke_request(base, token=posted["access_token"], client_id=post_id, client_secret="not-it"),
        revoke_request(base, token=posted["access_token"], client_id=post_id),
        revoke_request(base, token=posted["access_token"], client_id=post_id, client_secret=""),
        revoke_request(base, token=basic["access_token"], client_id=basic_id),
        revoke_request(base, token=basic["access_token"], auth=httpx.BasicAuth(basic_id, "not-it")),
        revoke_request(base, token=posted["access_token"]),
    ):
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"] == "invalid_client", refused.text
        assert refused.headers["Cache-Control"] == "no-store"
    for tokens in (posted, basic):
        assert mcp_call(base, tokens["access_token"], "list_memory", {}).status_code == 200
    assert not OAuthGrant.objects.filter(revoked_at__isnull=False).exists()

    right = revoke_request(base, token=posted["access_token"], client_id=post_id, client_secret=post_secret)
    in_header = revoke_request(
        base, token=basic["access_token"], client_id=basic_id, auth=httpx.BasicAuth(basic_id, basic_secret)
    )
    for answer, tokens in ((right, posted), (in_header, basic)):
        assert answer.status_code == 200, answer.text
        assert mcp_call(base, tokens["access_token"], "list_memory", {}).status_code == 401
    log = live["log"].read_text()
    assert post_secret not in log and basic_secret not in log
