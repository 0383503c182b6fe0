"""Invalid text (NUL, C0 controls) in the web UI's own pages, the consent page, the SDK's
OAuth endpoints and bearer tokens: a coded 4xx in each surface's shape, never a 500, never
the offending text echoed, and nothing stored. Before the fix each of these was a psycopg
DataError: Postgres refuses NUL in text."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from urllib.parse import urlencode

import pytest
from django.test import AsyncClient

from audit.models import AuditEvent
from memories.auth import authenticate_bearer, bearer_token
from memories.models import ApiKey
from oauth import provider, services
from oauth.cimd import MetadataDocumentError, metadata_url_check
from oauth.models import OAuthAuthorizationRequest, OAuthClient
from oauth.selectors import oauth_authorization_request_pending
from tests.oauth_helpers import oauth_in_process

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

# Distinctive text next to the bad character: it must never come back in an answer.
MARK = "Zq7SecretText"
CALLBACK = "http://127.0.0.1:5555/cb"
FORM = "application/x-www-form-urlencoded"


@pytest.fixture
def alice_browser(client, alice):
    client.force_login(alice)
    return client


def _assert_page(response, status: int, *words: bytes) -> None:
    assert response.status_code == status, response.content[:300]
    assert response["Content-Type"].startswith("text/html")
    assert MARK.encode() not in response.content
    for word in words:
        assert word in response.content, word


# --- web: API keys (defect 1) ---------------------------------------------------------------
@pytest.mark.parametrize("bad", ["\x00", "\x01", "\x1f"])
def test_key_name_with_invalid_text_is_a_400_page_and_creates_nothing(alice_browser, bad):
    name = f"{MARK}{bad}"
    # The test client posts multipart; a browser posts urlencoded: both are checked.
    multipart = alice_browser.post("/keys/", {"name": name})
    _assert_page(multipart, 400, b"invalid_argument", b"name")
    urlencoded = alice_browser.post("/keys/", urlencode({"name": name}), content_type=FORM)
    _assert_page(urlencoded, 400, b"invalid_argument", b"name")
    assert not ApiKey.objects.exists()
    assert alice_browser.post("/keys/", {"name": "fine"}).status_code == 200
    assert ApiKey.objects.filter(name="fine").count() == 1


def test_nul_in_a_parameter_name_is_refused_without_echoing_it(alice_browser):
    response = alice_browser.post("/keys/", urlencode({f"{MARK}\x00": "x", "name": "k"}), content_type=FORM)
    _assert_page(response, 400, b"A parameter name contains a NUL character")
    assert not ApiKey.objects.exists()


def test_key_revoke_with_nul_in_the_id_is_a_404_page(alice_browser, alice):
    from memories.services import api_key_issue

    api_key_issue(user=alice, name="kept")
    for path in ("/keys/a%00/revoke/", f"/keys/{MARK}%00/revoke/", "/keys/a%00/chat/"):
        _assert_page(alice_browser.post(path), 404, b"not_found", b"NUL character")
    assert ApiKey.objects.get(name="kept").revoked_at is None


def test_the_async_handler_answers_the_same(alice):
    """Under ASGI the middleware chain is async: the check and the page run in a thread."""

    async def main():
        client = AsyncClient()
        await client.aforce_login(alice)
        name = await client.post("/keys/", {"name": f"{MARK}\x00"})
        revoke = await client.post("/keys/a%00/revoke/")
        return name, revoke

    name, revoke = asyncio.run(main())
    _assert_page(name, 400, b"invalid_argument")
    _assert_page(revoke, 404, b"not_found")
    assert not ApiKey.objects.exists()


def test_login_with_nul_is_a_400_page(client):
    response = client.post("/accounts/login/", {"username": f"{MARK}\x00", "password": "x"})
    _assert_page(response, 400, b"username")
    _assert_page(client.get("/accounts/login/?next=/%00"), 400, b"next")


# --- web: consent (defect 2) ----------------------------------------------------------------
def _client_row() -> OAuthClient:
    return OAuthClient.objects.create(
        client_id="test-client", kind=OAuthClient.Kind.DCR, redirect_uris=[CALLBACK], token_endpoint_auth_method="none"
    )


def _pending_key() -> str:
    return services.oauth_authorization_begin(
        client=_client_row(),
        redirect_uri=CALLBACK,
        redirect_uri_explicit=True,
        state="s",
        scopes=["read", "write"],
        code_challenge="c" * 43,
        resource="http://testserver/engines/memory/mcp",
    )


def test_consent_with_nul_in_the_key_is_a_404_page(alice_browser):
    for path in ("/oauth/consent/a%00/", f"/oauth/consent/{MARK}%00/"):
        _assert_page(alice_browser.get(path), 404, b"not_found")
        _assert_page(alice_browser.post(path, {"scope": "read"}), 404, b"not_found")
    assert oauth_authorization_request_pending(request_key=f"{MARK}\x00") is None


def test_consent_with_nul_in_a_scope_decides_nothing(alice_browser):
    key = _pending_key()
    audit_rows = AuditEvent.objects.count()
    response = alice_browser.post(f"/oauth/consent/{key}/", {"scope": ["read", f"{MARK}\x00"]})
    _assert_page(response, 400, b"scope")
    assert OAuthAuthorizationRequest.objects.get(request_key=key).decided_at is None
    assert AuditEvent.objects.count() == audit_rows
    assert alice_browser.get(f"/oauth/consent/{key}/").status_code == 200  # still answerable


def test_connected_apps_and_metadata_refuse_nul(alice_browser):
    _assert_page(alice_browser.get("/oauth/apps/?x=%00"), 400, b"invalid_argument")
    metadata = alice_browser.get("/.well-known/oauth-authorization-server?x=%00")
    assert metadata.status_code == 400
    assert metadata.json()["error"] == "invalid_request"


# --- what the middleware leaves alone -------------------------------------------------------
def test_admin_keeps_its_plain_text_answers(client, django_user_model):
    staff = django_user_model.objects.create_superuser("sam", "sam@example.com", "sam-password-1")
    client.force_login(staff)
    response = client.get("/admin/memories/apikey/a%00/change/")
    assert response.status_code == 404 and response["Content-Type"].startswith("text/plain")
    assert response.content.startswith(b"not_found:")
    response = client.get(f"/admin/memories/apikey/?q={MARK}%00")
    assert response.status_code == 400 and response.content.startswith(b"invalid_argument:")
    assert MARK.encode() not in response.content


def test_dispatcher_routes_are_not_pre_empted(api_client, alice_key, client):
    """/v1/ (REST and the chat proxy) validates in its dispatcher, in its JSON shape, and
    audits the failure: the middleware must not answer first."""
    audit_rows = AuditEvent.objects.count()
    response = api_client(alice_key).get("/v1/memories?cursor=%00")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_argument"
    assert AuditEvent.objects.count() == audit_rows + 1
    proxy = client.post("/v1/chat/completions?x=%00", data=b"{}", content_type="application/json")
    assert proxy["Content-Type"].startswith("application/json"), proxy.content[:200]


def test_web_memory_pages_still_flash_and_audit_through_the_dispatcher(alice_browser):
    audit_rows = AuditEvent.objects.count()
    response = alice_browser.get("/memories/?cursor=%00")
    assert response.status_code == 400
    assert "web/memory_list.html" in [template.name for template in response.templates]  # the page itself
    assert AuditEvent.objects.count() == audit_rows + 1  # the dispatcher's row: not pre-empted
    # The import page's multipart upload is the view's to read: its error is flashed.
    upload = alice_browser.post("/data/import/", {"source": "memsite\x00", "file": _upload()})
    assert upload.status_code == 302 and upload["Location"] == "/data/"


def _upload():
    from django.core.files.uploadedfile import SimpleUploadedFile

    return SimpleUploadedFile("memories.jsonl", b'{"memory": "x"}\n', content_type="application/x-ndjson")


# --- the SDK's OAuth endpoints (defect 3) ---------------------------------------------------
def _oauth(*requests: tuple[str, str, dict]) -> list:
    """Send (method, path, httpx arguments) to the OAuth ASGI apps in-process."""
    return oauth_in_process(*requests)


def _oauth_error(response, status: int, error: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"] == error, response.text
    assert MARK not in response.text and "\\u0000" not in response.text


def _register(body) -> tuple:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return ("POST", "/oauth/register", {"content": content, "headers": {"Content-Type": "application/json"}})


def test_register_refuses_invalid_text_and_deep_nesting():
    good = {"redirect_uris": [CALLBACK], "token_endpoint_auth_method": "none"}
    deep = b'{"redirect_uris": ["' + CALLBACK.encode() + b'"], "x": ' + b"[" * 200 + b"]" * 200 + b"}"
    responses = _oauth(
        _register({**good, "client_name": f"a{MARK}\u0000b"}),  # the reviewer's body
        _register({**good, f"{MARK}\u0000": 1}),  # a key
        _register({**good, "redirect_uris": [f"{CALLBACK}?{MARK}\u0001"]}),
        _register({**good, "contacts": [f"{MARK}\u0000"]}),
        _register(deep),
        _register(b"{not json"),
        _register({**good, "client_name": "Fine"}),
    )
    for response in responses[:-1]:
        _oauth_error(response, 400, "invalid_client_metadata")
    assert responses[-1].status_code == 201, responses[-1].text
    assert list(OAuthClient.objects.values_list("client_name", flat=True)) == ["Fine"]
    assert not AuditEvent.objects.exclude(detail__client_name="Fine").exists()


def test_token_revoke_and_authorize_refuse_invalid_text():
    basic = base64.b64encode(f"a{MARK}\x00b:secret".encode()).decode()
    basic_escaped = base64.b64encode(b"a%00b:secret").decode()
    token_form = {"grant_type": "authorization_code", "code": "mso_ac_x", "code_verifier": "v" * 43}
    responses = _oauth(
        ("POST", "/oauth/token", {"data": {**token_form, "client_id": f"a{MARK}\x00b"}}),
        ("POST", "/oauth/token", {"data": token_form, "headers": {"Authorization": f"Basic {basic}"}}),
        ("POST", "/oauth/token", {"data": token_form, "headers": {"Authorization": f"Basic {basic_escaped}"}}),
        ("POST", "/oauth/revoke", {"data": {"token": f"a{MARK}\x00b", "client_id": "a\x00"}}),
        ("GET", "/oauth/authorize?" + urlencode({"client_id": f"a{MARK}\x00b", "response_type": "code"}), {}),
        ("GET", "/oauth/authorize?" + urlencode({"client_id": f"https://127.0.0.1/{MARK}\x00"}), {}),
        ("POST", "/oauth/authorize", {"data": {"client_id": "a\x00", "response_type": "code"}}),
    )
    for response in responses[:4]:
        _oauth_error(response, 401, "invalid_client")
    for response in responses[4:]:
        _oauth_error(response, 400, "invalid_client")


def test_authorize_with_invalid_state_parks_nothing():
    client = _client_row()
    params = {
        "client_id": client.client_id, "response_type": "code", "redirect_uri": CALLBACK,
        "code_challenge": "c" * 43, "code_challenge_method": "S256",
    }  # fmt: skip
    bad, good = _oauth(
        ("GET", "/oauth/authorize?" + urlencode({**params, "state": f"{MARK}\x00"}), {}),
        ("GET", "/oauth/authorize?" + urlencode({**params, "state": "fine"}), {}),
    )
    _oauth_error(bad, 400, "invalid_request")
    assert good.status_code == 302 and "/oauth/consent/" in good.headers["location"], good.text
    assert list(OAuthAuthorizationRequest.objects.values_list("state", flat=True)) == ["fine"]


def test_authorize_refuses_what_its_columns_cannot_hold_instead_of_failing_or_cutting():
    """A state over 1024 characters was cut (the client got another state back); a
    resource with a long query matched the endpoint's path and failed the insert
    (server_error). Both are refused, and nothing is parked."""
    client = _client_row()
    params = {
        "client_id": client.client_id, "response_type": "code", "redirect_uri": CALLBACK,
        "code_challenge": "c" * 43, "code_challenge_method": "S256",
    }  # fmt: skip
    resource = "http://testserver/engines/memory/mcp?" + "q" * 2100
    long_state, long_resource, fine = _oauth(
        ("GET", "/oauth/authorize?" + urlencode({**params, "state": "s" * 1025}), {}),
        ("GET", "/oauth/authorize?" + urlencode({**params, "resource": resource}), {}),
        ("GET", "/oauth/authorize?" + urlencode({**params, "state": "s" * 1024}), {}),
    )  # fmt: skip
    for refused, error in ((long_state, "invalid_request"), (long_resource, "invalid_target")):
        _oauth_error(refused, 400, error)  # answered directly: no redirect before consent
    assert fine.status_code == 302 and "/oauth/consent/" in fine.headers["location"], fine.text
    assert list(OAuthAuthorizationRequest.objects.values_list("state", flat=True)) == ["s" * 1024]


def test_register_with_a_scope_named_many_times_keeps_it_once():
    """scopes_check tests the set of names; the raw string was stored and overflowed its
    column (a 500)."""
    body = {"redirect_uris": [CALLBACK], "token_endpoint_auth_method": "none", "scope": " ".join(["read"] * 60)}
    (registered,) = _oauth(_register(body))
    assert registered.status_code == 201, registered.text
    assert OAuthClient.objects.get().scope == "read"


def test_the_checked_endpoints_still_read_their_bodies():
    """The input check buffers the body and replays it: the SDK handler sees the same form."""
    _client_row()
    (token,) = _oauth(
        ("POST", "/oauth/token", {"data": {"grant_type": "authorization_code", "code": "mso_ac_unknown",
                                            "code_verifier": "v" * 43, "client_id": "test-client"}}),
    )  # fmt: skip
    _oauth_error(token, 400, "invalid_grant")


def test_services_refuse_invalid_text_themselves():
    """Behind the endpoint check, the services never hand such text to Postgres either."""
    assert provider._client_lookup(f"a{MARK}\x00") is None
    with pytest.raises(services.OAuthError) as registered:
        services.oauth_client_register(
            metadata={"client_id": "x", "redirect_uris": [CALLBACK], "client_name": f"{MARK}\x00"}, client_secret=None
        )
    assert registered.value.error == "invalid_client_metadata" and MARK not in registered.value.description
    with pytest.raises(services.OAuthError) as begun:
        services.oauth_authorization_begin(
            client=_client_row(), redirect_uri=CALLBACK, redirect_uri_explicit=True, state=f"{MARK}\x00",
            scopes=["read"], code_challenge="c" * 43, resource="http://testserver/engines/memory/mcp",
        )  # fmt: skip
    assert begun.value.error == "invalid_request" and MARK not in begun.value.description
    with pytest.raises(MetadataDocumentError):
        metadata_url_check("https://example.com/a\x00")
    assert not OAuthAuthorizationRequest.objects.exists()


# --- bearer tokens (defect 4) ---------------------------------------------------------------
def test_bearer_token_with_invalid_text_is_an_invalid_key(alice_key, api_client):
    for bad in ("Bearer msk_ab\x00cd_secret", f"Bearer {alice_key}\x00", f"Bearer {alice_key[:8]}\x01{alice_key[8:]}"):
        assert bearer_token(bad) is None
        assert authenticate_bearer(bad) is None
        response = api_client().get("/v1/memories", HTTP_AUTHORIZATION=bad)
        assert response.status_code == 401
        assert 'error="invalid_token"' in response["WWW-Authenticate"]
    assert authenticate_bearer(f"Bearer {alice_key}") is not None


def test_a_form_field_over_the_parsers_limit_is_a_400_not_a_500():
    """Starlette's form parser refuses a field over 1 MiB by raising; the client
    authenticator parsed the form first and let it through as a 500."""
    big = "a" * (1024 * 1024 + 10)
    responses = _oauth(
        ("POST", "/oauth/token", {"data": {"grant_type": "authorization_code", "code": "x", "client_id": big}}),
        ("POST", "/oauth/revoke", {"data": {"token": big, "client_id": "c"}}),
    )
    for response in responses:
        _oauth_error(response, 400, "invalid_request")
        assert "aaaa" not in response.text


def test_a_client_id_longer_than_any_clients_is_refused_without_quoting_it(caplog):
    """The SDK's "Client ID '...' not found" quoted the id whole: a 900 KB form field came
    back as a 900 KB answer. An id longer than any client's (512) is refused before the
    SDK, for a GET's query and a POST's form, as a client that cannot be identified (with
    the request's state at /authorize), never quoted, never logged. A well-formed unknown
    id keeps the SDK's answer."""
    caplog.set_level(logging.DEBUG)
    base = {"response_type": "code", "code_challenge": "c" * 43, "state": "st"}
    long_query, long_form = f"{MARK}-" + "q" * 20_000, f"{MARK}-" + "f" * 900_000
    token_form = {"grant_type": "authorization_code", "code": "mso_ac_x", "code_verifier": "v" * 43}
    in_query, in_form, at_token, at_revoke, unknown = _oauth(
        ("GET", "/oauth/authorize?" + urlencode({**base, "client_id": long_query}), {}),
        ("POST", "/oauth/authorize", {"data": {**base, "client_id": long_form}}),
        ("POST", "/oauth/token", {"data": {**token_form, "client_id": long_form}}),
        ("POST", "/oauth/revoke", {"data": {"token": "mso_at_x", "client_id": long_query}}),
        ("GET", "/oauth/authorize?" + urlencode({**base, "client_id": "no-such-client"}), {}),
    )
    for response, status in ((in_query, 400), (in_form, 400), (at_token, 401), (at_revoke, 401)):
        assert len(response.content) < 200, response.text[:200]
        _oauth_error(response, status, "invalid_client")
        assert response.json()["error_description"] == "client_id is longer than 512 characters"
    assert in_query.json()["state"] == in_form.json()["state"] == "st"
    _oauth_error(unknown, 400, "invalid_request")
    assert unknown.json()["error_description"] == "Client ID 'no-such-client' not found"
    assert MARK not in caplog.text


def test_a_client_id_is_never_cut_to_name_another_client():
    """The lookup cut a client_id to 512 characters, so an id one character longer than a
    512-character client's named that client (through HTTP Basic, which the form check
    does not see)."""
    OAuthClient.objects.create(
        client_id="k" * 512, kind=OAuthClient.Kind.DCR, redirect_uris=[CALLBACK], token_endpoint_auth_method="none"
    )
    assert provider._client_lookup("k" * 512) is not None
    assert provider._client_lookup("k" * 513) is None
    basic = base64.b64encode(("k" * 513 + ":").encode()).decode()
    token_form = {"grant_type": "authorization_code", "code": "mso_ac_x", "code_verifier": "v" * 43}
    (token,) = _oauth(("POST", "/oauth/token", {"data": token_form, "headers": {"Authorization": f"Basic {basic}"}}))
    _oauth_error(token, 401, "invalid_client")


# --- a parameter sent more than once (RFC 6749 §3.1) ----------------------------------------
def _authorize_params(client: OAuthClient) -> list[tuple[str, str]]:
    return [
        ("client_id", client.client_id), ("response_type", "code"), ("redirect_uri", CALLBACK),
        ("code_challenge", "c" * 43), ("code_challenge_method", "S256"),
    ]  # fmt: skip


def _form(items: list[tuple[str, str]]) -> dict:
    """httpx arguments posting `items` as a form, a name as often as it comes."""
    return {"content": urlencode(items), "headers": {"Content-Type": FORM}}


def _assert_repeated(response, status: int, error: str, name: str) -> None:
    _oauth_error(response, status, error)
    assert "location" not in response.headers
    assert response.json()["error_description"].startswith(f"{name} was sent more than once"), response.text


def test_a_repeated_authorization_parameter_in_a_get_is_refused_directly(caplog):
    """RFC 6749 §3.1: a parameter MUST NOT be sent more than once (§4.1.2.1: invalid_request).
    The SDK took one of the values: state twice parked a request with the last state,
    client_id twice chose the last client. Now a direct 400 naming the parameter, never its
    values; the state only when it was sent once; nothing parked, nothing logged."""
    caplog.set_level(logging.DEBUG)
    params = _authorize_params(_client_row())
    other = f"http://127.0.0.1:5555/{MARK}"
    state_twice, redirect_twice, client_twice = _oauth(
        ("GET", "/oauth/authorize?" + urlencode([*params, ("state", f"{MARK}-a"), ("state", f"{MARK}-b")]), {}),
        ("GET", "/oauth/authorize?" + urlencode([*params, ("redirect_uri", other), ("state", "st")]), {}),
        ("GET", "/oauth/authorize?" + urlencode([("client_id", f"{MARK}-c"), *params, ("state", "st")]), {}),
    )
    _assert_repeated(state_twice, 400, "invalid_request", "state")
    assert "state" not in state_twice.json()  # neither of the two comes back
    _assert_repeated(redirect_twice, 400, "invalid_request", "redirect_uri")
    _assert_repeated(client_twice, 400, "invalid_request", "client_id")
    assert redirect_twice.json()["state"] == client_twice.json()["state"] == "st"
    assert not OAuthAuthorizationRequest.objects.exists()
    assert MARK not in caplog.text


def test_a_repeated_authorization_parameter_in_a_posted_form_is_refused_directly(caplog):
    """A POST is read from its form, as the SDK reads it."""
    caplog.set_level(logging.DEBUG)
    params = _authorize_params(_client_row())
    redirect_twice, state_twice = _oauth(
        ("POST", "/oauth/authorize", _form([*params, ("state", "st"), ("redirect_uri", f"{CALLBACK}/{MARK}")])),
        ("POST", "/oauth/authorize", _form([*params, ("state", f"{MARK}-a"), ("state", f"{MARK}-b")])),
    )
    _assert_repeated(redirect_twice, 400, "invalid_request", "redirect_uri")
    assert redirect_twice.json()["state"] == "st"
    _assert_repeated(state_twice, 400, "invalid_request", "state")
    assert "state" not in state_twice.json()
    assert not OAuthAuthorizationRequest.objects.exists()
    assert MARK not in caplog.text


def test_a_repeated_resource_is_refused_as_a_target_this_server_cannot_serve():
    """RFC 8707 §2 lets a client name several resources; a token here serves one (the SDK
    kept the last). invalid_target, answered directly, with the state."""
    resource = "http://testserver/engines/memory/mcp"
    query = [*_authorize_params(_client_row()), ("resource", resource), ("resource", resource), ("state", "st")]
    (response,) = _oauth(("GET", "/oauth/authorize?" + urlencode(query), {}))
    _assert_repeated(response, 400, "invalid_target", "resource")
    assert response.json()["state"] == "st"
    assert not OAuthAuthorizationRequest.objects.exists()


def test_only_what_the_sdk_reads_and_knows_is_checked_for_repeats():
    """A POST's query is not read (its form is); an unrecognized parameter is ignored
    (RFC 6749 §3.1), repeated or not. Both still reach the consent page."""
    params = _authorize_params(_client_row())
    posted, unknown = _oauth(
        ("POST", "/oauth/authorize?state=a&state=b", _form([*params, ("state", "st")])),
        ("GET", "/oauth/authorize?" + urlencode([*params, ("x-extra", "1"), ("x-extra", "2"), ("state", "st")]), {}),
    )
    for response in (posted, unknown):
        assert response.status_code == 302 and "/oauth/consent/" in response.headers["location"], response.text
    assert list(OAuthAuthorizationRequest.objects.values_list("state", flat=True)) == ["st", "st"]


def test_a_repeated_token_parameter_is_refused(caplog):
    """The SDK and its client authenticator took one of the values: code twice was
    exchanged as the last, client_id twice authenticated the last. Now invalid_request,
    400, naming the parameter, never its values."""
    caplog.set_level(logging.DEBUG)
    _client_row()
    form = [("grant_type", "authorization_code"), ("code_verifier", "v" * 43), ("client_id", "test-client")]
    code_twice, client_twice, once = _oauth(
        ("POST", "/oauth/token", _form([*form, ("code", f"mso_ac_{MARK}1"), ("code", f"mso_ac_{MARK}2")])),
        ("POST", "/oauth/token", _form([*form, ("code", "mso_ac_x"), ("client_id", MARK)])),
        ("POST", "/oauth/token", _form([*form, ("code", "mso_ac_x")])),
    )
    _assert_repeated(code_twice, 400, "invalid_request", "code")
    _assert_repeated(client_twice, 400, "invalid_request", "client_id")
    _oauth_error(once, 400, "invalid_grant")  # sent once: the SDK's answer, as before
    assert MARK not in caplog.text


def test_a_repeated_revocation_parameter_is_refused(caplog):
    """token twice revoked the last of the two. Now invalid_request, 400."""
    caplog.set_level(logging.DEBUG)
    _client_row()
    form = [("client_id", "test-client"), ("client_secret", "")]
    token_twice, once = _oauth(
        ("POST", "/oauth/revoke", _form([*form, ("token", f"mso_at_{MARK}1"), ("token", f"mso_at_{MARK}2")])),
        ("POST", "/oauth/revoke", _form([*form, ("token", "mso_at_x")])),
    )
    _assert_repeated(token_twice, 400, "invalid_request", "token")
    assert once.status_code == 200, once.text  # RFC 7009: an unknown token is no error
    assert MARK not in caplog.text
