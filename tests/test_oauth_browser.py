"""The consent and "Connected apps" pages in real headless Chromium against the live
server (issue 16). Screenshots go to docs/screenshots/."""

from __future__ import annotations

import httpx
import pytest

from tests.oauth_helpers import authorize_url, pkce, query_of, token_request
from tests.test_browser import Page, browser  # noqa: F401 - the browser fixture
from tests.test_oauth import CURSOR_REDIRECTS, mcp_call

pytestmark = pytest.mark.slow


def test_consent_grants_less_and_connected_apps_revokes(browser, memsite_server, alice):  # noqa: F811, ARG001
    base = memsite_server
    callback = f"{base}/oauth-test-callback"  # loopback: the browser lands on our own 404, code in the URL
    registered = httpx.post(
        f"{base}/oauth/register",
        json={
            "client_name": "Cursor",
            "redirect_uris": [*CURSOR_REDIRECTS, callback],
            "token_endpoint_auth_method": "none",
        },
    )
    assert registered.status_code == 201, registered.text
    client_id = registered.json()["client_id"]
    verifier, challenge = pkce()
    page = Page(browser, base)
    page.driver.get(
        authorize_url(
            base, response_type="code", client_id=client_id, redirect_uri=callback, state="b1",
            code_challenge=challenge, code_challenge_method="S256", scope="read write delete offline_access",
        )
    )  # fmt: skip
    assert "/accounts/login/" in browser.current_url
    page.fill("#id_username", "alice")
    page.fill("#id_password", "alice-password-1")
    page.click("button[type=submit]")
    assert page.text_of("#client-name") == "Cursor"
    assert "Delete memories" in page.text and "registered itself" in page.text
    page.shot("oauth-01-consent")
    page.find("#scope-delete").click()  # grant less than asked: no delete
    page.click("#allow")
    assert browser.current_url.startswith(callback)
    answer = query_of(browser.current_url)
    assert answer["state"] == "b1" and answer["iss"] == base
    tokens = token_request(
        base, grant_type="authorization_code", code=answer["code"], redirect_uri=callback, client_id=client_id,
        code_verifier=verifier,
    ).json()  # fmt: skip
    assert tokens["scope"] == "read write offline_access"
    assert mcp_call(base, tokens["access_token"], "list_memory", {}).status_code == 200

    page.open("/oauth/apps/")
    row = page.text_of("#connected-apps tbody tr")
    assert "Cursor" in row and "read, write" in row and "delete" not in row.replace("Disconnect", "")
    page.shot("oauth-02-connected-apps")
    page.click("#connected-apps button.danger")
    assert "App disconnected" in page.text and "No connected apps." in page.text
    page.shot("oauth-03-disconnected")
    assert mcp_call(base, tokens["access_token"], "list_memory", {}).status_code == 401
