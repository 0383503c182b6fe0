"""Session 32 on the chat proxy's admin token API (`/v1/admin/tokens`): an unexpected
failure answers in the proxy's JSON error shape, audited, with no exception text; expired
keys are treated as revoked ones; a revoked or expired key's settings can be deleted; the
list is paged; the audit rows name the credential used."""

from __future__ import annotations

import django.db
import httpx
import pytest

from audit.models import AuditEvent
from core.choices import Operation
from memories.models import ApiKey
from memories.services import api_key_issue
from proxy import services as proxy_services
from proxy.services import token_config_save
from tests.conftest import internal_call, serve_in_thread

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

SECRET_TEXT = "sk-live-do-not-show-1234"


@pytest.fixture(scope="module")
def proxy_url(django_db_setup):  # noqa: ARG001 - the server uses the test database
    yield from serve_in_thread("memsite.asgi:build_application", factory=True, lifespan="on")


@pytest.fixture
def staff(alice, alice_key) -> dict[str, str]:
    alice.is_staff = True
    alice.is_superuser = True  # every TokenConfig permission (tests/test_proxy_admin_access.py)
    alice.save()
    return {"Authorization": f"Bearer {alice_key}"}


def configured(user, name: str) -> ApiKey:
    api_key, _ = api_key_issue(user=user, name=name)
    fields = {"upstream_base_url": f"https://api.{name}.example", "upstream_api_key": f"sk-{name}"}
    token_config_save(api_key=api_key, fields=fields, partial=False, call=internal_call())
    return api_key


def admin_rows() -> list[tuple]:
    rows = AuditEvent.objects.filter(operation=Operation.PROXY_TOKEN_CONFIG).exclude(channel="internal")
    return list(rows.order_by("id").values_list("subject_user_id", "outcome", "error_code"))


def assert_proxy_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["x-memsite-error"] == code
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "memsite_error"
    assert SECRET_TEXT not in response.text and "Traceback" not in response.text


# --- 1: an unexpected failure is answered in the proxy's shape and audited ----------------------


def test_an_unexpected_failure_is_a_json_500_audited_without_its_text(
    proxy_url, staff, alice, bob, monkeypatch, caplog
):
    """An exception no layer answered gave Django's HTML "Server Error (500)" page and no
    audit row, where every refusal of this API is JSON in the proxy's shape and audited.
    It is 500 `internal_error` now, the exception's text (which may quote a secret) in
    neither the answer, the audit row nor the log, and audited as the dispatcher records
    an unexpected failure: under the key's owner once the call named a key."""
    bob_key = configured(bob, "bob")

    def broken(**kwargs):
        raise RuntimeError(f"cannot save {SECRET_TEXT}")

    monkeypatch.setattr(proxy_services, "token_config_save", broken)
    monkeypatch.setattr(proxy_services, "token_configs_admin_list", broken)
    url = f"{proxy_url}/v1/admin/tokens"
    patched = httpx.patch(f"{url}/{bob_key.key_id}", headers=staff, json={"memory_limit": 3})
    assert_proxy_error(patched, 500, "internal_error")
    assert_proxy_error(httpx.get(url, headers=staff), 500, "internal_error")

    error = AuditEvent.Outcome.ERROR
    assert admin_rows() == [(bob.pk, error, "backend_unavailable"), (alice.pk, error, "backend_unavailable")]
    assert SECRET_TEXT not in str(list(AuditEvent.objects.values_list("detail", flat=True)))
    assert SECRET_TEXT not in caplog.text


def test_a_lost_database_is_a_coded_503_in_the_proxys_shape(proxy_url, staff, bob, monkeypatch):
    """A database that cannot be reached is 503 `backend_unavailable` with Retry-After (as
    on every surface), not the other JSON shape handler500 gives it."""
    bob_key = configured(bob, "bob")

    def lost(**kwargs):
        raise django.db.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(proxy_services, "token_config_admin_get", lost)
    response = httpx.get(f"{proxy_url}/v1/admin/tokens/{bob_key.key_id}", headers=staff)
    assert_proxy_error(response, 503, "backend_unavailable")
    assert response.headers["retry-after"] == "5"
