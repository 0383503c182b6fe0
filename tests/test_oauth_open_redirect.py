"""/oauth/authorize is no open redirector (RFC 9700 §4.11.2): anyone may register a client
with any https redirect, so an error found before the user has answered the consent page
is answered directly (400, OAuth JSON, with the request's `state`: RFC 6749 §4.1.2.1),
never redirected to the client. The consent page's redirect, and the consent page's answer
(code or access_denied, with the state) to the client, stay."""

from __future__ import annotations

import json
import logging
import secrets
from urllib.parse import parse_qsl, urlencode, urlsplit

import pytest

from oauth.models import OAuthAuthorizationRequest
from tests.oauth_helpers import oauth_in_process, pkce, query_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

EVIL = "https://evil.example/x"
# The bound of a state the flow stores and gives back after consent.
STATE_MAX_CHARS = OAuthAuthorizationRequest._meta.get_field("state").max_length


def _register(redirect_uri: str = EVIL) -> str:
    body = {"redirect_uris": [redirect_uri], "token_endpoint_auth_method": "none"}
    (registered,) = oauth_in_process(
        ("POST", "/oauth/register", {"content": json.dumps(body), "headers": {"Content-Type": "application/json"}})
    )
    assert registered.status_code == 201, registered.text
    return registered.json()["client_id"]


def _authorize(**params: str) -> tuple[str, str, dict]:
    return ("GET", "/oauth/authorize?" + urlencode(params), {})


def _assert_answered_directly(response, error: str) -> None:
    assert response.status_code == 400, (response.status_code, response.headers.get("location"))
    assert "location" not in response.headers
    assert response.json()["error"] == error, response.text
    assert response.headers["Cache-Control"] == "no-store"


def test_a_self_registered_clients_redirect_gets_no_error_before_consent():
    """The reviewer's attack: register https://evil.example/x, hand out an authorize link
    with any error in it; the server bounced the browser there without login or consent."""
    client_id = _register()
    _, challenge = pkce()
    good = {"client_id": client_id, "response_type": "code", "code_challenge": challenge, "state": "anything"}
    missing_pkce = {key: value for key, value in good.items() if key != "code_challenge"}
    responses = oauth_in_process(
        _authorize(**missing_pkce),
        _authorize(**good, scope="admin"),
        _authorize(**good, resource="https://evil.example/mcp"),
        _authorize(**good, code_challenge_method="plain"),
        _authorize(**{**good, "response_type": "token"}),
        _authorize(**good, redirect_uri=EVIL, resource="http://testserver/engines/memory/mcp?x=1"),
    )
    errors = [
        "invalid_request", "invalid_scope", "invalid_target", "invalid_request", "unsupported_response_type",
        "invalid_target",
    ]  # fmt: skip
    for response, error in zip(responses, errors, strict=True):
        _assert_answered_directly(response, error)
    assert "code_challenge" in responses[0].json()["error_description"]
    assert not OAuthAuthorizationRequest.objects.exists()


def test_the_answer_names_the_real_error_when_the_redirect_has_a_query_of_its_own():
    """The SDK appends its error after the registered redirect's own query: the direct
    answer reports the SDK's, not a look-alike planted in the registered URI."""
    client_id = _register(f"{EVIL}?error=access_denied&error_description=planted")
    (response,) = oauth_in_process(_authorize(client_id=client_id, response_type="code", state="s"))
    _assert_answered_directly(response, "invalid_request")
    assert "code_challenge" in response.json()["error_description"]


def test_the_legitimate_flow_still_redirects_to_consent_and_then_to_the_client(client, alice):
    client_id = _register()
    _, challenge = pkce()
    params = {
        "client_id": client_id, "response_type": "code", "code_challenge": challenge, "code_challenge_method": "S256",
        "state": "st", "scope": "read write offline_access", "resource": "http://testserver/engines/memory/mcp",
    }  # fmt: skip
    allowed, denied = oauth_in_process(_authorize(**params), _authorize(**params))
    for answer in (allowed, denied):
        assert answer.status_code == 302, answer.text
        assert answer.headers["location"].startswith("http://testserver/oauth/consent/")
    client.force_login(alice)
    consent = urlsplit(allowed.headers["location"]).path
    assert client.get(consent).status_code == 200
    granted = client.post(consent, {"allow": "", "scope": ["read", "write"]})
    assert granted.status_code == 302 and granted["Location"].startswith(EVIL + "?")
    assert query_of(granted["Location"])["state"] == "st" and query_of(granted["Location"])["code"]
    # Refusing on the consent page still tells the client, at its registered redirect.
    refused = client.post(urlsplit(denied.headers["location"]).path, {"deny": ""})
    assert refused.status_code == 302
    assert query_of(refused["Location"]) == {"error": "access_denied", "state": "st", "iss": "http://testserver"}


def test_a_direct_error_carries_the_requests_state(caplog):
    """The SDK put the state on the error it redirected; answered directly instead, the
    error lost it, and a client could not tell which of its authorization requests
    failed. Every direct error gives it back: the SDK's redirected ones, the SDK's own
    direct answers, the input check's and the metadata-document check's, for a GET's
    query and a POSTed form. Never logged."""
    caplog.set_level(logging.DEBUG)
    client_id = _register()
    _, challenge = pkce()
    state = "st-" + secrets.token_urlsafe(24)
    good = {"client_id": client_id, "response_type": "code", "code_challenge": challenge, "state": state}
    missing_pkce = {key: value for key, value in good.items() if key != "code_challenge"}
    responses = oauth_in_process(
        _authorize(**missing_pkce),
        _authorize(**good, scope="admin"),
        _authorize(**good, resource="https://evil.example/mcp"),
        _authorize(**{**good, "client_id": "no-such-client"}),
        _authorize(**good, redirect_uri="https://elsewhere.example/cb"),
        _authorize(**good, scope="read\x00"),
        _authorize(**{**good, "client_id": "http://127.0.0.1:9/client.json"}),
        ("POST", "/oauth/authorize", {"data": {**good, "scope": "admin"}}),
        ("POST", "/oauth/authorize", {"data": {**good, "scope": "read\x00"}}),
    )
    errors = [
        "invalid_request", "invalid_scope", "invalid_target", "invalid_request", "invalid_request",
        "invalid_request", "invalid_client", "invalid_scope", "invalid_request",
    ]  # fmt: skip
    for response, error in zip(responses, errors, strict=True):
        _assert_answered_directly(response, error)
        assert response.json()["state"] == state, response.text
    assert state not in caplog.text
    assert not OAuthAuthorizationRequest.objects.exists()


def test_a_state_is_given_back_whole_up_to_its_bound_and_otherwise_left_out():
    """Bounded as a stored state is (1024): a longer one is refused and not echoed, even
    where the SDK answered directly and echoed whatever it got; an empty one is no state
    (RFC 6749 A.5, as the consent page's answer treats it); a state holding a NUL is the
    refused parameter, not echoed."""
    client_id = _register()
    _, challenge = pkce()
    base = {"client_id": client_id, "response_type": "code", "code_challenge": challenge}
    longest = "s" * STATE_MAX_CHARS
    at_bound, over, over_unknown_client, empty, nul = oauth_in_process(
        _authorize(**base, state=longest, scope="admin"),
        _authorize(**base, state=longest + "s"),
        _authorize(**{**base, "client_id": "no-such-client"}, state=longest + "s"),
        _authorize(**base, state="", scope="admin"),
        _authorize(**base, state="a\x00b"),
    )
    _assert_answered_directly(at_bound, "invalid_scope")
    assert at_bound.json()["state"] == longest
    _assert_answered_directly(over, "invalid_request")
    assert f"longer than {STATE_MAX_CHARS}" in over.json()["error_description"]
    _assert_answered_directly(over_unknown_client, "invalid_request")
    _assert_answered_directly(empty, "invalid_scope")
    _assert_answered_directly(nul, "invalid_request")
    for response in (over, over_unknown_client, empty, nul):
        assert "state" not in response.json(), response.text[:200]


def test_the_consent_pages_answers_carry_the_state_after_a_refused_post(client, alice):
    """The consent page's POST: granting nothing is the user's error, shown on the page
    (no answer to the client yet, the request still pending); the answer that follows,
    a code or access_denied, carries the state."""
    client_id = _register()
    _, challenge = pkce()
    params = {"client_id": client_id, "response_type": "code", "code_challenge": challenge, "state": "st-2"}
    first, second = oauth_in_process(_authorize(**params), _authorize(**params))
    client.force_login(alice)
    for answer, form in ((first, {"allow": ""}), (second, {"deny": ""})):
        consent = urlsplit(answer.headers["location"]).path
        nothing = client.post(consent, {"allow": ""})
        assert nothing.status_code == 302 and nothing["Location"] == consent
        final = client.post(consent, {**form, "scope": ["read"]} if "allow" in form else form)
        assert final.status_code == 302 and final["Location"].startswith(EVIL + "?")
        assert query_of(final["Location"])["state"] == "st-2"


def test_a_posted_authorization_is_prechecked_on_its_form(caplog):
    """The metadata-document precheck read client_id and state from the query, where the
    SDK handler reads a POST's form: a bad document URL in the form got the SDK's bare
    'not found' instead of the reason, and one in the query of a POST whose form named a
    good client refused that client, with the query's state. Both now follow the form."""
    caplog.set_level(logging.DEBUG)
    client_id = _register()
    _, challenge = pkce()
    form = {"client_id": client_id, "response_type": "code", "code_challenge": challenge, "state": "form-state"}
    bad_document = "http://127.0.0.1:9/client.json"
    query = urlencode({"client_id": bad_document, "state": "query-state"})
    bad_in_form, bad_in_query = oauth_in_process(
        ("POST", "/oauth/authorize", {"data": {**form, "client_id": bad_document}}),
        ("POST", f"/oauth/authorize?{query}", {"data": form}),
    )
    _assert_answered_directly(bad_in_form, "invalid_client")
    assert bad_in_form.json() == {
        "error": "invalid_client",
        "error_description": "client_id metadata document URL must use https",
        "state": "form-state",
    }
    assert bad_in_query.status_code == 302, bad_in_query.text
    assert bad_in_query.headers["location"].startswith("http://testserver/oauth/consent/")
    assert list(OAuthAuthorizationRequest.objects.values_list("state", flat=True)) == ["form-state"]
    assert "form-state" not in caplog.text and "query-state" not in caplog.text


@pytest.mark.parametrize("answer", ["allow", "deny"])
def test_the_answer_after_consent_carries_a_state_only_when_the_client_sent_one(client, alice, answer):
    """RFC 6749 §4.1.2: state comes back exactly as received when the request had one; §3.1:
    a parameter sent without a value is treated as omitted. So no state sent and `state=`
    both come back without one (never `state=`), and a state comes back unchanged."""
    client_id = _register()
    _, challenge = pkce()
    base = {"client_id": client_id, "response_type": "code", "code_challenge": challenge}
    sent = [{}, {"state": ""}, {"state": "a b/c?d=e&f"}]
    started = oauth_in_process(*(_authorize(**base, **state) for state in sent))
    client.force_login(alice)
    form = {"allow": "", "scope": ["read"]} if answer == "allow" else {"deny": ""}
    for state, authorize in zip(sent, started, strict=True):
        assert authorize.status_code == 302, authorize.text
        final = client.post(urlsplit(authorize.headers["location"]).path, form)
        assert final.status_code == 302 and final["Location"].startswith(EVIL + "?")
        names = [name for name, _ in parse_qsl(urlsplit(final["Location"]).query, keep_blank_values=True)]
        assert names.count("state") == (1 if state.get("state") else 0), final["Location"]
        if state.get("state"):
            assert query_of(final["Location"])["state"] == state["state"]
