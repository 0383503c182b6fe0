"""Session 32 on the chat proxy's admin token API (`/v1/admin/tokens`): an unexpected
failure answers in the proxy's JSON error shape, audited, with no exception text; expired
keys are treated as revoked ones; a revoked or expired key's settings can be deleted; the
list is paged; the audit rows name the credential used."""

from __future__ import annotations

from datetime import timedelta

import django.db
import httpx
import pytest
from django.utils import timezone

from audit.models import AuditEvent
from core.choices import Operation
from memories.models import ApiKey
from memories.services import api_key_issue
from proxy import services as proxy_services
from proxy.models import TokenConfig
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


# --- 2 and 3: an expired key is treated as a revoked one; a retired key's settings can go --------


def expire(api_key: ApiKey) -> None:
    ApiKey.objects.filter(pk=api_key.pk).update(expires_at=timezone.now() - timedelta(minutes=1))


def test_an_expired_keys_settings_are_neither_listed_shown_nor_changed(proxy_url, staff, alice, bob):
    """A revoked key's settings were left out of the list and 404 for show and edit, but
    an expired key's, which never authenticates again either, were listed, shown and
    editable. An expired key is now treated as a revoked one."""
    live = configured(bob, "live")
    expired = configured(bob, "old")
    expire(expired)
    url = f"{proxy_url}/v1/admin/tokens"

    assert [t["key_id"] for t in httpx.get(url, headers=staff).json()["tokens"]] == [live.key_id]
    assert httpx.get(f"{url}/{expired.key_id}", headers=staff).status_code == 404
    assert httpx.patch(f"{url}/{expired.key_id}", headers=staff, json={"memory_limit": 3}).status_code == 404
    whole = {"upstream_base_url": "https://x.example", "upstream_api_key": "sk-x"}
    assert httpx.put(f"{url}/{expired.key_id}", headers=staff, json=whole).status_code == 404
    assert httpx.post(url, headers=staff, json={"key_id": expired.key_id, **whole}).status_code == 404
    assert TokenConfig.objects.get(api_key=expired).memory_limit == 5
    # A key expiring later is live.
    ApiKey.objects.filter(pk=live.pk).update(expires_at=timezone.now() + timedelta(days=1))
    assert httpx.get(f"{url}/{live.key_id}", headers=staff).status_code == 200


@pytest.mark.parametrize("retire", ["revoked", "expired"])
def test_a_retired_keys_settings_can_be_deleted_and_the_deletion_is_audited(proxy_url, staff, alice, bob, retire):
    """A revoked key's settings, its encrypted upstream API key among them, stayed in the
    database with no way to remove them: DELETE answered 404 like an unknown key. DELETE
    now removes a revoked or expired key's settings, audited under the owner with the
    staff account as actor; the answer and the audit row never carry the secret."""
    api_key = configured(bob, "gone")
    if retire == "revoked":
        ApiKey.objects.filter(pk=api_key.pk).update(revoked_at=timezone.now())
    else:
        expire(api_key)
    url = f"{proxy_url}/v1/admin/tokens/{api_key.key_id}"

    deleted = httpx.delete(url, headers=staff)
    assert deleted.status_code == 204, deleted.text
    assert not TokenConfig.objects.filter(api_key=api_key).exists()
    row = AuditEvent.objects.filter(operation=Operation.PROXY_TOKEN_CONFIG, staff_username=alice.username).get()
    assert row.subject_user_id == bob.pk and row.outcome == AuditEvent.Outcome.OK
    assert row.detail == {"key_id": api_key.key_id, "action": "delete", "fields": []}
    assert "sk-gone" not in str(row.detail)
    # Once gone, a second DELETE is the usual 404; other methods stay 404 for the key.
    assert httpx.delete(url, headers=staff).status_code == 404
    assert httpx.get(url, headers=staff).status_code == 404


@pytest.fixture
def carol_staff(django_user_model) -> dict[str, str]:
    carol = django_user_model.objects.create_user("carol", "carol@example.com", "carol-password-1")
    carol.is_staff = True
    carol.is_superuser = True
    carol.save()
    return {"Authorization": f"Bearer {api_key_issue(user=carol, name='carol')[1]}"}


# --- 4: the list is paged -------------------------------------------------------------------------


def test_the_list_is_paged_with_a_cursor_and_a_bounded_page_size(proxy_url, staff, alice, bob):
    """GET /v1/admin/tokens answered every configuration in one page, however many. It
    pages as /v1/memories does: `page_size` (1-200, default 50) and the opaque
    `next_cursor` of the previous page as `cursor`, null on the last page; each page's
    audit rows name only the keys it showed."""
    keys = [configured(bob, f"k{n}").key_id for n in range(5)]
    url = f"{proxy_url}/v1/admin/tokens"
    seen, cursor, pages = [], None, 0
    while True:
        params = {"page_size": "2", **({"cursor": cursor} if cursor else {})}
        page = httpx.get(url, headers=staff, params=params)
        assert page.status_code == 200, page.text
        body = page.json()
        assert len(body["tokens"]) <= 2
        seen += [t["key_id"] for t in body["tokens"]]
        pages += 1
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert pages == 3 and seen == keys
    listed = AuditEvent.objects.filter(operation=Operation.PROXY_TOKEN_CONFIG, staff_username=alice.username)
    assert [row["key_ids"] for row in listed.order_by("id").values_list("detail", flat=True)] == [
        keys[:2],
        keys[2:4],
        keys[4:],
    ]
    assert httpx.get(url, headers=staff).json()["next_cursor"] is None  # 5 < the default 50


@pytest.mark.parametrize(
    "params",
    [
        {"page_size": "0"},
        {"page_size": "201"},
        {"page_size": "two"},
        {"page_size": "²"},
        {"cursor": "not-a-cursor"},
        {"cursor": "x" * 600},
        {"limit": "5"},
        [("page_size", "2"), ("page_size", "3")],
    ],
)
def test_bad_paging_parameters_are_a_clear_422(proxy_url, staff, alice, bob, params):
    configured(bob, "k")
    response = httpx.get(f"{proxy_url}/v1/admin/tokens", headers=staff, params=params)
    assert_proxy_error(response, 422, "invalid_argument")
    assert admin_rows() == [(alice.pk, AuditEvent.Outcome.ERROR, "invalid_argument")]


def test_a_cursor_is_the_staff_accounts_own(proxy_url, staff, alice, bob, carol_staff):
    """A cursor is sealed for the staff account it was issued to: another's is refused."""
    for n in range(3):
        configured(bob, f"k{n}")
    url = f"{proxy_url}/v1/admin/tokens"
    cursor = httpx.get(url, headers=staff, params={"page_size": "1"}).json()["next_cursor"]
    assert cursor
    response = httpx.get(url, headers=carol_staff, params={"cursor": cursor})
    assert_proxy_error(response, 422, "invalid_argument")


# --- 5: the audit rows name the credential used -------------------------------------------------


def test_the_admin_apis_audit_rows_name_the_key_used(proxy_url, staff, alice, alice_key, bob):
    """The admin API's audit rows named the staff account but not the credential it used
    (two keys of one account were indistinguishable, a leaked key's calls unfindable):
    every row now carries `key:<key id>`, as every other API call's row does, never the
    secret."""
    bob_key = configured(bob, "bob")
    bare = api_key_issue(user=bob, name="bare")[0]
    url = f"{proxy_url}/v1/admin/tokens"
    assert httpx.get(url, headers=staff).status_code == 200
    assert httpx.get(f"{url}/{bob_key.key_id}", headers=staff).status_code == 200
    assert httpx.patch(f"{url}/{bob_key.key_id}", headers=staff, json={"memory_limit": 3}).status_code == 200
    assert httpx.get(f"{url}/{bare.key_id}", headers=staff).status_code == 404
    assert httpx.delete(f"{url}/{bob_key.key_id}", headers=staff).status_code == 204

    key_id = alice_key[len(ApiKey.PREFIX) :].partition("_")[0]
    rows = AuditEvent.objects.filter(operation=Operation.PROXY_TOKEN_CONFIG, staff_username=alice.username)
    got = list(rows.order_by("id").values_list("subject_user_id", "actor_auth", "actor_credential"))
    assert got == [(bob.pk, "api_key", f"key:{key_id}")] * 5
    secret = alice_key.rpartition("_")[2]
    assert not AuditEvent.objects.filter(actor_credential__contains=secret).exists()
