"""RFC 6749 §5.2: a client that tried to authenticate at /oauth/token or /oauth/revoke with
the Authorization header (HTTP Basic) and failed gets a 401 with a WWW-Authenticate naming
that scheme. Before, no 401 of either endpoint carried one."""

from __future__ import annotations

import base64

import pytest

from oauth.provider import BASIC_CHALLENGE
from tests.oauth_helpers import oauth_in_process

pytestmark = [pytest.mark.django_db(transaction=True)]

MARK = "Zq7ClientText"  # a client's own text: never in the challenge
TOKEN_FORM = {"grant_type": "authorization_code", "code": "mso_ac_x", "code_verifier": "v" * 43}


def _basic(client_id: str, secret: str, *, scheme: str = "Basic") -> dict:
    return {"Authorization": f"{scheme} {base64.b64encode(f'{client_id}:{secret}'.encode()).decode()}"}


def _challenges(response) -> list[str]:
    return [value for name, value in response.headers.multi_items() if name.lower() == "www-authenticate"]


def _register(method: str) -> tuple[str, str]:
    (answer,) = oauth_in_process(
        (
            "POST",
            "/oauth/register",
            {"json": {"redirect_uris": ["http://127.0.0.1:5555/cb"], "token_endpoint_auth_method": method}},
        )
    )
    assert answer.status_code == 201, answer.text
    return answer.json()["client_id"], answer.json()["client_secret"]


def test_a_client_failing_basic_authentication_is_challenged_with_basic():
    basic_id, basic_secret = _register("client_secret_basic")
    responses = oauth_in_process(
        # The SDK's TokenHandler and RevocationHandler (via _client_refusal_named): a wrong secret.
        ("POST", "/oauth/token", {"data": TOKEN_FORM, "headers": _basic(basic_id, "not-it")}),
        ("POST", "/oauth/revoke", {"data": {"token": "mso_at_x"}, "headers": _basic(basic_id, "not-it")}),
        # An unknown client, credentials that are no base64, a lower-case scheme name.
        ("POST", "/oauth/token", {"data": TOKEN_FORM, "headers": _basic(f"{MARK}-unknown", "s")}),
        ("POST", "/oauth/token", {"data": TOKEN_FORM, "headers": {"Authorization": f"Basic {MARK}%%%"}}),
        ("POST", "/oauth/revoke", {"data": {"token": "x"}, "headers": _basic(basic_id, "no", scheme="basic")}),
        # Refused by our input checks before the SDK: a client_id holding NUL, one too long.
        (
            "POST",
            "/oauth/token",
            {"data": {**TOKEN_FORM, "client_id": f"{MARK}\x00"}, "headers": _basic(basic_id, basic_secret)},
        ),
        (
            "POST",
            "/oauth/revoke",
            {"data": {"token": "x", "client_id": MARK * 100}, "headers": _basic(basic_id, basic_secret)},
        ),
    )
    for response in responses:
        assert response.status_code == 401, response.text
        assert response.json()["error"] == "invalid_client", response.text
        assert _challenges(response) == [BASIC_CHALLENGE], response.headers
    assert BASIC_CHALLENGE == 'Basic realm="oauth", charset="UTF-8"'


def test_only_a_failed_basic_authentication_is_challenged():
    """A client authenticating in the form (or a public one) is refused without a challenge:
    RFC 6749 §5.2 asks for it only when the header was used, and Basic is not the scheme
    such a client used. A Basic client that authenticated, refused or answered for another
    reason, gets none either."""
    basic_id, basic_secret = _register("client_secret_basic")
    post_id, _ = _register("client_secret_post")
    wrong_in_form, at_revoke, no_client, bad_grant, revoked = oauth_in_process(
        ("POST", "/oauth/token", {"data": {**TOKEN_FORM, "client_id": post_id, "client_secret": "not-it"}}),
        ("POST", "/oauth/revoke", {"data": {"token": "x", "client_id": post_id, "client_secret": "not-it"}}),
        ("POST", "/oauth/token", {"data": TOKEN_FORM}),
        (
            "POST",
            "/oauth/token",
            {"data": {**TOKEN_FORM, "client_id": basic_id}, "headers": _basic(basic_id, basic_secret)},
        ),
        (
            "POST",
            "/oauth/revoke",
            {"data": {"token": "mso_at_x", "client_id": basic_id}, "headers": _basic(basic_id, basic_secret)},
        ),
    )
    for response in (wrong_in_form, at_revoke, no_client):
        assert response.status_code == 401 and response.json()["error"] == "invalid_client", response.text
        assert _challenges(response) == []
    assert bad_grant.status_code == 400 and bad_grant.json()["error"] == "invalid_grant", bad_grant.text
    assert revoked.status_code == 200, revoked.text
    assert _challenges(bad_grant) == _challenges(revoked) == []
