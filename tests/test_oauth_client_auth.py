"""Client authentication at /oauth/token and /oauth/revoke, against the live server.

- RFC 7235 §2.1 / RFC 9110 §11.1: the auth-scheme is case-insensitive, so `basic` and
  `BASIC` credentials are read as `Basic` ones (before, they were not read at all: the
  client was refused as one that sent no secret).
- RFC 6749 §2.3.1: a client authenticating with HTTP Basic need not repeat its client_id
  in the form (before, the SDK's request models refused the request, 400 "client_id:
  Field required"); a form client_id naming another client than the header's is a
  malformed request, 400 invalid_request.
- A public client (auth method none) has no secret: one that presents a client_secret is
  refused, 401 invalid_client (before, the secret was ignored).
- RFC 6749 §2.3: one authentication method per request. HTTP Basic and a form
  client_secret together are 400 invalid_request (RFC 6749 §5.2), before the credentials
  are checked (before, Basic won and the form's secret was ignored). Either method alone
  serves a client with a secret, whichever one it registered (not enforced: see
  docs/architecture.md).
- RFC 6749 §2.3.1: the Basic user-id and password are the client_id and secret
  form-urlencoded, so they are form-decoded (`+` a space, `%2B` a `+`); before, they were
  only percent-decoded, and a client encoding as the RFC says was refused.
- RFC 7591 §2: a registration naming no token_endpoint_auth_method is client_secret_basic
  (before, client_secret_post, the SDK's default); the SDK's own client then uses Basic."""

from __future__ import annotations

import base64
from urllib.parse import quote, quote_plus

import httpx
import pytest

from oauth import services
from oauth.models import OAuthClient
from tests.oauth_helpers import ScriptedUser, authorize_url, oauth_in_process, pkce, query_of
from tests.test_oauth import CALLBACK, _remember_and_search, mcp_call, sdk_session

MARK = "Zq7ClientText"  # a client's own text: never in an answer or the log


@pytest.fixture
def live(memsite_server_process, memsite_server):  # noqa: ARG001
    return memsite_server_process


def _register(base: str, method: str) -> tuple[str, str | None]:
    answer = httpx.post(
        f"{base}/oauth/register",
        json={"client_name": f"App ({method})", "redirect_uris": [CALLBACK], "token_endpoint_auth_method": method},
        timeout=30,
    )
    assert answer.status_code == 201, answer.text
    return answer.json()["client_id"], answer.json().get("client_secret")


def _code(base: str, user: ScriptedUser, client_id: str) -> tuple[str, str]:
    """(code, code_verifier) of a fresh consent."""
    verifier, challenge = pkce()
    redirect = user.authorize(
        authorize_url(
            base, response_type="code", client_id=client_id, redirect_uri=CALLBACK, state="st",
            code_challenge=challenge, code_challenge_method="S256",
        )
    )  # fmt: skip
    return query_of(redirect)["code"], verifier


def _code_form(code: str, verifier: str, **extra: str) -> dict[str, str]:
    return {
        "grant_type": "authorization_code",
        "code": code,
        "redirect_uri": CALLBACK,
        "code_verifier": verifier,
        **extra,
    }


def _basic(client_id: str, secret: str, *, scheme: str = "Basic ") -> dict[str, str]:
    """`scheme`: the scheme name and the spaces after it."""
    return {"Authorization": f"{scheme}{base64.b64encode(f'{client_id}:{secret}'.encode()).decode()}"}


def _basic_encoded(client_id: str, secret: str, encode) -> dict[str, str]:
    """Basic credentials with the id and secret each encoded by `encode` first (RFC 6749 §2.3.1)."""
    return _basic(encode(client_id), encode(secret))


def _post(base: str, path: str, form: dict[str, str], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{base}{path}", data=form, headers=headers, timeout=30)


def _challenges(response: httpx.Response) -> list[str]:
    return [value for name, value in response.headers.multi_items() if name.lower() == "www-authenticate"]


def test_the_basic_scheme_is_read_whatever_its_case(live, alice):  # noqa: ARG001
    base = live["url"]
    user = ScriptedUser(base, "alice", "alice-password-1")
    client_id, secret = _register(base, "client_secret_basic")
    assert secret
    for scheme in ("basic ", "BASIC ", "bAsIc ", "Basic  "):  # RFC 7235 §2.1: 1*SP after it
        code, verifier = _code(base, user, client_id)
        answer = _post(
            base,
            "/oauth/token",
            _code_form(code, verifier, client_id=client_id),
            _basic(client_id, secret, scheme=scheme),
        )
        assert answer.status_code == 200, (scheme, answer.text)
    refreshed = _post(
        base,
        "/oauth/token",
        {"grant_type": "refresh_token", "refresh_token": answer.json()["refresh_token"], "client_id": client_id},
        _basic(client_id, secret, scheme="basic "),
    )
    assert refreshed.status_code == 200, refreshed.text
    access = refreshed.json()["access_token"]
    assert mcp_call(base, access, "list_memory", {}).status_code == 200
    revoked = _post(
        base, "/oauth/revoke", {"token": access, "client_id": client_id}, _basic(client_id, secret, scheme="BASIC ")
    )
    assert revoked.status_code == 200, revoked.text
    assert mcp_call(base, access, "list_memory", {}).status_code == 401
    # Still refused, and challenged, with a wrong secret under a lower-case scheme.
    wrong = _post(base, "/oauth/revoke", {"token": "mso_at_x"}, _basic(client_id, "not-it", scheme="basic "))
    assert wrong.status_code == 401 and wrong.json()["error"] == "invalid_client", wrong.text
    assert _challenges(wrong) == ['Basic realm="oauth", charset="UTF-8"']
    assert secret not in live["log"].read_text()


def test_a_basic_client_leaves_client_id_out_of_the_form(live, alice):  # noqa: ARG001
    """RFC 6749 §2.3.1: the Basic user-id is the client_id. The authorization_code and
    refresh_token grants and a revocation work without it in the form; an empty one is
    the same as none (RFC 6749 §3.1)."""
    base = live["url"]
    user = ScriptedUser(base, "alice", "alice-password-1")
    client_id, secret = _register(base, "client_secret_basic")
    assert secret
    code, verifier = _code(base, user, client_id)
    issued = _post(base, "/oauth/token", _code_form(code, verifier), _basic(client_id, secret))
    assert issued.status_code == 200, issued.text
    refreshed = _post(
        base,
        "/oauth/token",
        {"grant_type": "refresh_token", "refresh_token": issued.json()["refresh_token"]},
        _basic(client_id, secret),
    )
    assert refreshed.status_code == 200, refreshed.text
    again = _post(
        base,
        "/oauth/token",
        {"grant_type": "refresh_token", "refresh_token": refreshed.json()["refresh_token"], "client_id": ""},
        _basic(client_id, secret),
    )
    assert again.status_code == 200, again.text
    access = again.json()["access_token"]
    assert mcp_call(base, access, "list_memory", {}).status_code == 200
    revoked = _post(base, "/oauth/revoke", {"token": access}, _basic(client_id, secret))
    assert revoked.status_code == 200, revoked.text
    assert mcp_call(base, access, "list_memory", {}).status_code == 401
    # Without the header the client_id is still required: nothing names the client.
    code, verifier = _code(base, user, client_id)
    unnamed = _post(base, "/oauth/token", _code_form(code, verifier))
    assert unnamed.status_code == 401 and unnamed.json()["error"] == "invalid_client", unnamed.text
    assert secret not in live["log"].read_text()


def test_a_form_client_id_naming_another_client_than_basic_is_refused(live, alice):  # noqa: ARG001
    """RFC 6749 §5.2 invalid_request: a request naming two clients is malformed, whatever
    the credentials are worth; answered before they are checked, naming neither id."""
    base = live["url"]
    user = ScriptedUser(base, "alice", "alice-password-1")
    client_id, secret = _register(base, "client_secret_basic")
    other_id, other_secret = _register(base, "client_secret_post")
    assert secret and other_secret
    code, verifier = _code(base, user, client_id)
    refused = [
        _post(base, "/oauth/token", _code_form(code, verifier, client_id=other_id), _basic(client_id, secret)),
        _post(base, "/oauth/token", _code_form(code, verifier, client_id=other_id), _basic(client_id, "not-it")),
        _post(
            base,
            "/oauth/token",
            _code_form(code, verifier, client_id=other_id, client_secret=other_secret),
            _basic(client_id, secret),
        ),
    ]
    # The code was not spent: the request naming one client exchanges it.
    issued = _post(base, "/oauth/token", _code_form(code, verifier, client_id=client_id), _basic(client_id, secret))
    assert issued.status_code == 200, issued.text
    access = issued.json()["access_token"]
    refused.append(_post(base, "/oauth/revoke", {"token": access, "client_id": other_id}, _basic(client_id, secret)))
    for answer in refused:
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"] == "invalid_request", answer.text
        assert answer.headers["Cache-Control"] == "no-store"
        assert _challenges(answer) == []
        for text in (client_id, other_id, secret, other_secret):
            assert text not in answer.text
    assert mcp_call(base, access, "list_memory", {}).status_code == 200


def test_a_public_client_presenting_a_secret_is_refused(live, alice):  # noqa: ARG001
    """A public client (token_endpoint_auth_method none, RFC 7591 §2: it has no secret)
    presenting one is refused as a client whose authentication failed (RFC 6749 §5.2
    invalid_client): the secret cannot be checked, so the request is not what it claims.
    An empty client_secret is an omitted one (RFC 6749 §3.1)."""
    base = live["url"]
    user = ScriptedUser(base, "alice", "alice-password-1")
    client_id, secret = _register(base, "none")
    assert secret is None
    code, verifier = _code(base, user, client_id)
    in_form = _post(base, "/oauth/token", _code_form(code, verifier, client_id=client_id, client_secret=MARK))
    in_header = _post(base, "/oauth/token", _code_form(code, verifier), _basic(client_id, MARK))
    for answer in (in_form, in_header):
        assert answer.status_code == 401, answer.text
        assert answer.json()["error"] == "invalid_client", answer.text
        assert MARK not in answer.text
    assert _challenges(in_form) == []
    assert _challenges(in_header) == ['Basic realm="oauth", charset="UTF-8"']
    issued = _post(base, "/oauth/token", _code_form(code, verifier, client_id=client_id, client_secret=""))
    assert issued.status_code == 200, issued.text
    access = issued.json()["access_token"]
    refused = _post(base, "/oauth/revoke", {"token": access, "client_id": client_id, "client_secret": MARK})
    assert refused.status_code == 401 and refused.json()["error"] == "invalid_client", refused.text
    assert MARK not in refused.text
    refreshed = _post(
        base,
        "/oauth/token",
        {
            "grant_type": "refresh_token",
            "refresh_token": issued.json()["refresh_token"],
            "client_id": client_id,
            "client_secret": MARK,
        },
    )
    assert refreshed.status_code == 401 and refreshed.json()["error"] == "invalid_client", refreshed.text
    assert mcp_call(base, access, "list_memory", {}).status_code == 200
    revoked = _post(base, "/oauth/revoke", {"token": access, "client_id": client_id})
    assert revoked.status_code == 200, revoked.text
    assert mcp_call(base, access, "list_memory", {}).status_code == 401
    assert MARK not in live["log"].read_text()


@pytest.mark.django_db(transaction=True)
def test_a_basic_client_id_no_client_has_is_refused_unquoted():
    """The header's client_id, now handed to the SDK handler in the form, is refused as a
    form one is: 401 invalid_client, never quoted (NUL text, longer than any client's, unknown)."""
    form = {"grant_type": "refresh_token", "refresh_token": "mso_rt_x"}
    answers = oauth_in_process(
        *(
            (method, path, {"data": data, "headers": _basic(client_id, MARK)})
            for client_id in (f"{MARK}\x00", MARK * 100, f"{MARK}-unknown")
            for method, path, data in (("POST", "/oauth/token", form), ("POST", "/oauth/revoke", {"token": "x"}))
        )
    )
    for answer in answers:
        assert answer.status_code == 401, answer.text
        assert answer.json()["error"] == "invalid_client", answer.text
        assert MARK not in answer.text


def _assert_two_methods_refused(answer: httpx.Response, client_id: str, secret: str) -> None:
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == "invalid_request", answer.text
    assert answer.headers["Cache-Control"] == "no-store"
    assert _challenges(answer) == []
    for text in (client_id, secret, MARK):
        assert text not in answer.text


def test_basic_and_a_form_client_secret_together_are_refused(live, alice):  # noqa: ARG001
    """RFC 6749 §2.3: a client MUST NOT use more than one authentication method in a
    request; §5.2 lists it under invalid_request. Refused whatever the credentials are
    worth (before they are checked), spending no code, rotating or revoking no token,
    naming neither id nor secret, with no challenge (a 400, not a failed authentication)."""
    base = live["url"]
    user = ScriptedUser(base, "alice", "alice-password-1")
    client_id, secret = _register(base, "client_secret_basic")
    post_id, post_secret = _register(base, "client_secret_post")
    assert secret and post_secret
    code, verifier = _code(base, user, client_id)
    refused = [
        _post(base, "/oauth/token", _code_form(code, verifier, client_secret=secret), _basic(client_id, secret)),
        _post(
            base,
            "/oauth/token",
            _code_form(code, verifier, client_id=client_id, client_secret=secret),
            _basic(client_id, secret, scheme="basic "),
        ),
        _post(base, "/oauth/token", _code_form(code, verifier, client_secret=MARK), _basic(client_id, secret)),
        _post(base, "/oauth/token", _code_form(code, verifier, client_secret=secret), _basic(client_id, MARK)),
        _post(
            base,
            "/oauth/token",
            _code_form(code, verifier, client_id=client_id, client_secret=secret),
            {"Authorization": f"Basic {MARK}!"},  # unreadable: still a second method
        ),
    ]
    for answer in refused:
        _assert_two_methods_refused(answer, client_id, secret)
    # The code was not spent: Basic alone, with an empty client_secret (none, RFC 6749 §3.1).
    issued = _post(base, "/oauth/token", _code_form(code, verifier, client_secret=""), _basic(client_id, secret))
    assert issued.status_code == 200, issued.text
    refresh, access = issued.json()["refresh_token"], issued.json()["access_token"]
    refused = [
        _post(
            base,
            "/oauth/token",
            {"grant_type": "refresh_token", "refresh_token": refresh, "client_id": client_id, "client_secret": secret},
            _basic(client_id, secret),
        ),
        _post(base, "/oauth/revoke", {"token": access, "client_secret": secret}, _basic(client_id, secret)),
    ]
    for answer in refused:
        _assert_two_methods_refused(answer, client_id, secret)
    assert mcp_call(base, access, "list_memory", {}).status_code == 200
    # The refresh token was not rotated: Basic alone uses it.
    refreshed = _post(
        base, "/oauth/token", {"grant_type": "refresh_token", "refresh_token": refresh}, _basic(client_id, secret)
    )
    assert refreshed.status_code == 200, refreshed.text
    # Not the method refused, the two at once: this client_secret_basic client may revoke
    # with its secret in the form.
    access = refreshed.json()["access_token"]
    revoked = _post(base, "/oauth/revoke", {"token": access, "client_id": client_id, "client_secret": secret})
    assert revoked.status_code == 200, revoked.text
    assert mcp_call(base, access, "list_memory", {}).status_code == 401

    # The same for a client_secret_post client; HTTP Basic alone serves it too.
    code, verifier = _code(base, user, post_id)
    both = _post(
        base, "/oauth/token", _code_form(code, verifier, client_id=post_id, client_secret=post_secret),
        _basic(post_id, post_secret),
    )  # fmt: skip
    _assert_two_methods_refused(both, post_id, post_secret)
    issued = _post(base, "/oauth/token", _code_form(code, verifier), _basic(post_id, post_secret))
    assert issued.status_code == 200, issued.text
    log = live["log"].read_text()
    for text in (secret, post_secret, MARK):
        assert text not in log


def test_basic_credentials_are_form_decoded(live, alice):  # noqa: ARG001
    """RFC 6749 §2.3.1: the client_id and secret are form-urlencoded before they become the
    Basic user-id and password, so a space is sent as `+` (as Go's x/oauth2 does, with
    url.QueryEscape) and a `+` as `%2B`. Such a client was refused: `+` was read as `+`. The
    Python SDK's encoding (`quote`, a space as `%20`) still works. A registered client has a
    UUID and a hex secret, which no encoding changes: this one is made as an operator would
    pre-register it, with `:`, `+`, `%` and spaces in both."""
    base = live["url"]
    client_id, secret = "Pre:registered app+1 x%", f"{MARK} s3:cr+t%2B x"
    services.oauth_client_register(
        metadata={
            "client_id": client_id,
            "client_name": "Pre-registered",
            "redirect_uris": [CALLBACK],
            "token_endpoint_auth_method": "client_secret_basic",
        },
        client_secret=secret,
    )
    user = ScriptedUser(base, "alice", "alice-password-1")
    code, verifier = _code(base, user, client_id)
    issued = _post(base, "/oauth/token", _code_form(code, verifier), _basic_encoded(client_id, secret, quote_plus))
    assert issued.status_code == 200, issued.text
    # With the form's client_id too: the header's, decoded, is the same client.
    refreshed = _post(
        base,
        "/oauth/token",
        {"grant_type": "refresh_token", "refresh_token": issued.json()["refresh_token"], "client_id": client_id},
        _basic_encoded(client_id, secret, quote_plus),
    )
    assert refreshed.status_code == 200, refreshed.text
    # The Python SDK client's encoding (mcp/client/auth: quote(..., safe="")).
    sdk_encoded = _basic_encoded(client_id, secret, lambda text: quote(text, safe=""))
    again = _post(
        base,
        "/oauth/token",
        {"grant_type": "refresh_token", "refresh_token": refreshed.json()["refresh_token"], "client_id": client_id},
        sdk_encoded,
    )
    assert again.status_code == 200, again.text
    access = again.json()["access_token"]
    assert mcp_call(base, access, "list_memory", {}).status_code == 200
    # `+` is a space: the secret with `+` for its spaces, sent as is, is another secret.
    plus_for_space = _basic(quote_plus(client_id), secret.replace(" ", "+"))
    wrong = _post(base, "/oauth/revoke", {"token": access}, plus_for_space)
    assert wrong.status_code == 401 and wrong.json()["error"] == "invalid_client", wrong.text
    assert MARK not in wrong.text
    revoked = _post(base, "/oauth/revoke", {"token": access}, _basic_encoded(client_id, secret, quote_plus))
    assert revoked.status_code == 200, revoked.text
    assert mcp_call(base, access, "list_memory", {}).status_code == 401
    assert MARK not in live["log"].read_text()


def test_a_registration_naming_no_auth_method_is_client_secret_basic(live, alice):  # noqa: ARG001
    """RFC 7591 §2: token_endpoint_auth_method "If omitted, the default is
    client_secret_basic"; it was registered and answered client_secret_post (the SDK
    handler's default). A method the registration names is kept. The MCP SDK's client,
    registering without one, is told client_secret_basic and signs in with HTTP Basic."""
    base = live["url"]
    for body in ({}, {"token_endpoint_auth_method": None}):
        answer = httpx.post(
            f"{base}/oauth/register", json={"client_name": "App", "redirect_uris": [CALLBACK], **body}, timeout=30
        )
        assert answer.status_code == 201, answer.text
        registered = answer.json()
        assert registered["token_endpoint_auth_method"] == "client_secret_basic", registered
        assert registered["client_secret"]
        row = OAuthClient.objects.get(client_id=registered["client_id"])
        assert row.token_endpoint_auth_method == "client_secret_basic"
    for method in ("client_secret_post", "client_secret_basic", "none"):
        client_id, _ = _register(base, method)
        assert OAuthClient.objects.get(client_id=client_id).token_endpoint_auth_method == method

    user = ScriptedUser(base, "alice", "alice-password-1")
    run, storage, _ = sdk_session(base, user, mode="auto", metadata_url=None, auth_method=None)
    stored, found = run(_remember_and_search)
    assert not stored.is_error and found.structured_content["results"]
    assert storage.client_info.token_endpoint_auth_method == "client_secret_basic"
    assert storage.client_info.client_secret
    row = OAuthClient.objects.get(client_id=storage.client_info.client_id)
    assert row.token_endpoint_auth_method == "client_secret_basic"
    assert storage.client_info.client_secret not in live["log"].read_text()
