"""Review rev004: a key's own upstream that cannot be connected to (a name that does not
resolve, a resolver that does not answer, a port no connection can use) answers 502
`upstream_unreachable` in OpenAI's error shape with one audit row, as the deployment's
default upstream does, never Django's HTML 500; and such a URL is refused when saved."""

from __future__ import annotations

import socket

import httpx
import pytest

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.choices import Operation
from core.errors import ServiceError
from memories.services import api_key_issue
from proxy import upstream_network
from proxy.models import ProxyTurn, TokenConfig
from proxy.services import token_config_save
from tests.conftest import internal_call, serve_in_thread

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

BAD_URLS = ["http://1.1.1.1:99999/", "http://:80/", "http://%00/", "http://127.0.0.1:0/", "http://user@:443/v1"]


@pytest.fixture(scope="module")
def proxy_url(django_db_setup):  # noqa: ARG001 - the server uses the test database
    yield from serve_in_thread("memsite.asgi:build_application", factory=True, lifespan="on")


def chat(url: str, key: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )


def assert_unreachable_and_recorded_once(response: httpx.Response) -> None:
    assert response.status_code == 502, response.text[:300]
    assert response.headers["x-memsite-error"] == "upstream_unreachable"
    assert response.json()["error"]["code"] == "upstream_unreachable"
    rows = AuditEvent.objects.filter(operation=Operation.CHAT_COMPLETION)
    assert list(rows.values_list("outcome", "error_code")) == [("error", "backend_unavailable")]
    assert not UsageEvent.objects.filter(operation=Operation.CHAT_COMPLETION).exists()
    assert not ProxyTurn.objects.exists()


def key_with_upstream(user, url: str) -> str:
    api_key, key = api_key_issue(user=user, name="own-upstream")
    fields = {"upstream_base_url": url, "upstream_api_key": "sk"}
    token_config_save(api_key=api_key, fields=fields, partial=False, call=internal_call())
    return key


def test_a_dns_failure_of_a_key_upstream_is_a_502(proxy_url, upstream, alice, monkeypatch):
    """A name that does not resolve (production's NXDOMAIN, a resolver outage): the lookup
    raises socket.gaierror, outside httpcore's own error mapping."""

    async def nxdomain(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(upstream_network.anyio, "getaddrinfo", nxdomain)
    key = key_with_upstream(alice, "https://api.typo-provider.com")
    assert_unreachable_and_recorded_once(chat(proxy_url, key))
    assert upstream.requests == []


def test_a_resolver_that_does_not_answer_is_a_502(proxy_url, upstream, alice, monkeypatch):
    async def silent(*args, **kwargs):
        raise TimeoutError

    monkeypatch.setattr(upstream_network.anyio, "getaddrinfo", silent)
    key = key_with_upstream(alice, "https://api.slow-resolver.com")
    assert_unreachable_and_recorded_once(chat(proxy_url, key))


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_saved_url_that_fails_every_call(proxy_url, upstream, alice, url):
    """Refused when saved (the service, hence the admin API's 422 and the web page's 400);
    a row saved before the check answers 502, not a 500."""
    api_key, key = api_key_issue(user=alice, name="k")
    with pytest.raises(ServiceError) as refused:
        token_config_save(
            api_key=api_key,
            fields={"upstream_base_url": url, "upstream_api_key": "sk"},
            partial=False,
            call=internal_call(),
        )
    assert refused.value.code == "invalid_argument" and "upstream_base_url" in refused.value.message
    assert not TokenConfig.objects.exists()

    token_config_save(
        api_key=api_key,
        fields={"upstream_base_url": "https://api.example.com", "upstream_api_key": "sk"},
        partial=False,
        call=internal_call(),
    )
    TokenConfig.objects.filter(api_key=api_key).update(upstream_base_url=url)  # saved before the check
    assert_unreachable_and_recorded_once(chat(proxy_url, key))


def test_the_admin_api_refuses_an_unusable_port_with_a_422(proxy_url, alice, alice_key, bob):
    alice.is_staff = True
    alice.is_superuser = True
    alice.save()
    body = {
        "key_id": api_key_issue(user=bob)[0].key_id,
        "upstream_base_url": "http://1.1.1.1:99999/",
        "upstream_api_key": "sk",
    }
    response = httpx.post(f"{proxy_url}/v1/admin/tokens", headers={"Authorization": f"Bearer {alice_key}"}, json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_argument"
    assert not TokenConfig.objects.exists()


# --- the deployment's default upstream: refused at start-up -------------------------------------


@pytest.mark.parametrize("url", [*BAD_URLS, "http://api.example.com /v1", "ftp://api.example.com"])
def test_an_unusable_default_upstream_stops_the_start(settings, url):
    """CHAT_UPSTREAM_BASE_URL serves every key without its own upstream: http://1.1.1.1:99999/
    gave an ExceptionGroup (a 500) on every such chat call. The system checks, which
    `manage.py migrate` runs before the launcher serves, now refuse it, without quoting it
    (a URL may hold credentials)."""
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError

    from memsite.checks import chat_upstream_url_check

    settings.CHAT_UPSTREAM_BASE_URL = url
    (error,) = chat_upstream_url_check()
    assert error.id == "memsite.E004" and "CHAT_UPSTREAM_BASE_URL is not a usable" in error.msg
    assert url not in error.msg + (error.hint or "")
    with pytest.raises(SystemCheckError, match="memsite.E004"):
        call_command("check")


@pytest.mark.parametrize("url", ["", "https://api.openai.com", "http://127.0.0.1:8001/v1", "http://upstream:80"])
def test_a_usable_or_no_default_upstream_passes_the_checks(settings, url):
    """The deployment's own upstream may be private or loopback (only a key's is restricted)."""
    from memsite.checks import chat_upstream_url_check

    settings.CHAT_UPSTREAM_BASE_URL = url
    assert chat_upstream_url_check() == []
