"""Web login end to end through a local fake OIDC provider: discovery, authorization
code with PKCE, token endpoint, JWKS; user created on first login; logout at the provider."""

import html
import re
import urllib.request
from urllib.parse import parse_qs, urlencode, urlsplit

import pytest

from memories.interfaces.web import oidc_login as oidc_web
from memories.models import ExternalIdentity
from tests.fakes import FakeOIDC

pytestmark = pytest.mark.django_db(transaction=True)


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


@pytest.fixture
def provider(settings):
    fake = FakeOIDC().start()
    settings.OIDC_ISSUER = fake.issuer
    settings.OIDC_AUDIENCE = "memsite"
    settings.OIDC_RP_CLIENT_ID = fake.client_id
    settings.OIDC_RP_CLIENT_SECRET = "web-secret"
    settings.OIDC_WEB_LOGIN = True
    settings.AUTHENTICATION_BACKENDS = [
        *settings.AUTHENTICATION_BACKENDS,
        "memories.interfaces.web.oidc_login.MemsiteOIDCBackend",
    ]
    oidc_web.discovery.cache_clear()
    yield fake
    oidc_web.discovery.cache_clear()
    fake.stop()


def _sign_in_at_provider(authorize_url: str) -> str:
    """The browser's trip to the provider: it signs the user in and redirects back."""
    opener = urllib.request.build_opener(NoRedirect)
    try:
        opener.open(authorize_url, timeout=10)
    except urllib.error.HTTPError as redirect:
        assert redirect.code == 302
        return redirect.headers["Location"]
    raise AssertionError("the provider did not redirect back")


def test_login_with_pkce_creates_the_user_and_logs_out_at_the_provider(client, provider):
    page = client.get("/accounts/login/")
    assert b"Sign in with your organisation" in page.content

    start = client.get("/oidc/authenticate/")
    assert start.status_code == 302
    authorize = start["Location"]
    query = parse_qs(urlsplit(authorize).query)
    assert authorize.startswith(f"{provider.url}/authorize")
    assert query["code_challenge_method"] == ["S256"] and query["code_challenge"][0]
    assert query["client_id"] == [provider.client_id] and "openid" in query["scope"][0]

    callback = _sign_in_at_provider(authorize)
    landed = client.get(callback.replace("http://testserver", ""))
    assert landed.status_code == 302 and landed["Location"] == "/memories/"

    identity = ExternalIdentity.objects.get(subject="web-user-1")
    assert identity.issuer == provider.issuer and identity.user.username == "erin"
    memories = client.get("/memories/")
    assert memories.status_code == 200 and b"Sign out erin" in memories.content
    assert b'action="/oidc/logout/"' in memories.content

    token_request = next(r for r in provider.requests if r["path"] == "/token")
    assert token_request["json"]["code_verifier"]  # PKCE verifier went to the token endpoint

    logout = client.post("/oidc/logout/")
    assert logout.status_code == 302 and logout["Location"].startswith(f"{provider.url}/logout?client_id=")
    assert client.get("/memories/").status_code == 302  # signed out here too


def test_second_login_reuses_the_user(client, provider):
    for _ in range(2):
        start = client.get("/oidc/authenticate/")
        client.get(_sign_in_at_provider(start["Location"]).replace("http://testserver", ""))
        client.logout()
    assert ExternalIdentity.objects.filter(subject="web-user-1").count() == 1


def test_a_forged_callback_is_refused(client, provider):
    client.get("/oidc/authenticate/")
    response = client.get("/oidc/callback/?code=made-up&state=wrong")
    assert response.status_code in (302, 400)
    assert not ExternalIdentity.objects.exists()
    assert client.get("/memories/").status_code == 302


def _organisation_link(page) -> str:
    found = re.search(r'href="([^"]*)">Sign in with your organisation', page.content.decode())
    assert found, "no organisation sign-in link"
    return html.unescape(found.group(1))


def test_the_organisation_sign_in_brings_the_user_back_to_next(client, provider):
    """Connecting an app: its consent page sends a signed-out user to the login page with
    `next`; signing in through the provider lands back there, not on My memories."""
    consent = "/oauth/consent/some-request/?lang=en&step=2"
    link = _organisation_link(client.get("/accounts/login/", {"next": consent}))
    assert link == f"/oidc/authenticate/?{urlencode({'next': consent})}"

    start = client.get(link)
    landed = client.get(_sign_in_at_provider(start["Location"]).replace("http://testserver", ""))
    assert landed.status_code == 302 and landed["Location"] == consent


@pytest.mark.parametrize("elsewhere", ["https://evil.example/steal", "//evil.example/", "javascript:alert(1)"])
def test_the_organisation_sign_in_drops_a_next_leading_elsewhere(client, provider, elsewhere):
    link = _organisation_link(client.get("/accounts/login/", {"next": elsewhere}))
    assert link == "/oidc/authenticate/"
    landed = client.get(_sign_in_at_provider(client.get(link)["Location"]).replace("http://testserver", ""))
    assert landed["Location"] == "/memories/"
