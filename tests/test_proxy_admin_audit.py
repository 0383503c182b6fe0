"""Review rev004 follow-ups on the chat proxy's admin token API (`/v1/admin/tokens`): a
staff read of users' upstream settings (list, show) is audited under each user whose
settings it showed, not billed; every refusal after authentication (404, 409, 413, 422)
leaves its audit row as the 401 and 403 do; the list shows live keys' settings only."""

from __future__ import annotations

import httpx
import pytest
from django.utils import timezone

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.choices import Operation
from memories.models import ApiKey
from memories.services import api_key_issue
from proxy.models import TokenConfig
from proxy.services import token_config_save
from tests.conftest import internal_call, serve_in_thread

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


@pytest.fixture(scope="module")
def proxy_url(django_db_setup):  # noqa: ARG001 - the server uses the test database
    yield from serve_in_thread("memsite.asgi:build_application", factory=True, lifespan="on")


@pytest.fixture
def staff(alice, alice_key) -> dict[str, str]:
    alice.is_staff = True
    alice.is_superuser = True  # every TokenConfig permission (tests/test_proxy_admin_access.py)
    alice.save()
    return {"Authorization": f"Bearer {alice_key}"}


@pytest.fixture
def carol(django_user_model):
    return django_user_model.objects.create_user("carol", "carol@example.com", "carol-password-1")


def configured(user, name: str) -> ApiKey:
    api_key, _ = api_key_issue(user=user, name=name)
    fields = {"upstream_base_url": f"https://api.{name}.example", "upstream_api_key": f"sk-{name}"}
    token_config_save(api_key=api_key, fields=fields, partial=False, call=internal_call())
    return api_key


def staff_rows(alice) -> list[tuple]:
    """The admin API's rows written for staff (setup's own saves have no staff actor)."""
    rows = AuditEvent.objects.filter(operation=Operation.PROXY_TOKEN_CONFIG, staff_username=alice.username)
    return list(rows.order_by("id").values_list("subject_user_id", "outcome", "error_code", "detail"))


def caller_rows(alice) -> list[tuple]:
    """Refusals recorded under the caller's own scope, naming the caller."""
    rows = AuditEvent.objects.filter(
        operation=Operation.PROXY_TOKEN_CONFIG, actor_username=alice.username, subject_user_id=alice.pk
    )
    return list(rows.order_by("id").values_list("outcome", "error_code"))


# --- 1: reading users' settings is audited -----------------------------------------------------


def test_listing_and_showing_settings_is_audited_under_each_owner(proxy_url, staff, alice, bob, carol):
    """GET /v1/admin/tokens read every user's upstream settings and left no audit row:
    a staff read of others' data. It now leaves one row per user shown, under that user
    (their Activity lists it), naming only their own keys; showing one key leaves one
    row under its owner. Not billed: a staff surface, as the admin's views."""
    bob_keys = [configured(bob, "bob1").key_id, configured(bob, "bob2").key_id]
    carol_key = configured(carol, "carol").key_id
    url = f"{proxy_url}/v1/admin/tokens"

    listed = httpx.get(url, headers=staff)
    assert listed.status_code == 200, listed.text
    assert sorted(t["key_id"] for t in listed.json()["tokens"]) == sorted([*bob_keys, carol_key])
    ok = AuditEvent.Outcome.OK
    assert staff_rows(alice) == [
        (bob.pk, ok, "", {"action": "list", "key_ids": bob_keys}),
        (carol.pk, ok, "", {"action": "list", "key_ids": [carol_key]}),
    ]

    shown = httpx.get(f"{url}/{carol_key}", headers=staff)
    assert shown.status_code == 200 and shown.json()["user"] == "carol"
    assert staff_rows(alice)[2:] == [(carol.pk, ok, "", {"key_id": carol_key, "action": "view", "fields": []})]
    # Each row is the staff account's, not the owner's doing; bob's never names carol's key.
    row = AuditEvent.objects.filter(staff_username=alice.username, subject_user_id=bob.pk).get()
    assert row.actor_user_id is None and row.staff_user_id == alice.pk and carol_key not in str(row.detail)
    assert not UsageEvent.objects.exists()


def test_an_empty_list_reads_nothing_and_records_nothing(proxy_url, staff, alice):
    assert httpx.get(f"{proxy_url}/v1/admin/tokens", headers=staff).json() == {"tokens": [], "next_cursor": None}
    assert staff_rows(alice) == []


# --- 3: the list shows live keys' settings only ------------------------------------------------


def test_a_revoked_keys_settings_are_not_listed(proxy_url, staff, alice, bob):
    """The list included the settings of revoked keys, which every other method answers
    404 for (a revoked key never authenticates again): an operator could not open, fix
    or delete what the list offered. It lists live keys' settings only."""
    live = configured(bob, "live")
    revoked = configured(bob, "gone")
    ApiKey.objects.filter(pk=revoked.pk).update(revoked_at=timezone.now())
    url = f"{proxy_url}/v1/admin/tokens"

    listed = httpx.get(url, headers=staff).json()["tokens"]
    assert [t["key_id"] for t in listed] == [live.key_id]
    assert httpx.get(f"{url}/{revoked.key_id}", headers=staff).status_code == 404
    # Only left out of the list: nothing is deleted.
    assert TokenConfig.objects.filter(api_key=revoked).exists()
    # The read's audit row names only what was shown.
    assert staff_rows(alice)[0][3] == {"action": "list", "key_ids": [live.key_id]}


# --- 2: refusals after authentication are audited ----------------------------------------------


def test_refusals_before_a_key_is_known_are_audited_under_the_caller(proxy_url, staff, alice, settings):
    """404 (an unknown key: another user's revoked key behaves the same), 422 (a body that
    is not JSON) and 413 left no audit row; only the 401 and 403 did."""
    url = f"{proxy_url}/v1/admin/tokens"
    assert httpx.get(f"{url}/nope", headers=staff).status_code == 404
    body = {"key_id": "nope", "upstream_base_url": "https://x.example", "upstream_api_key": "sk"}
    assert httpx.post(url, headers=staff, json=body).status_code == 404
    assert httpx.post(url, headers=staff, content=b"[" * 1000).status_code == 422
    big = b'{"x": "' + b"y" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 10) + b'"}'
    assert httpx.post(url, headers=staff, content=big).status_code == 413
    denied, error = AuditEvent.Outcome.DENIED, AuditEvent.Outcome.ERROR
    assert caller_rows(alice) == [
        (denied, "not_found"),
        (denied, "not_found"),
        (error, "invalid_argument"),
        (error, "payload_too_large"),
    ]
    assert staff_rows(alice) == []  # nobody's settings were touched


def test_refusals_on_a_known_key_are_audited_under_its_owner(proxy_url, staff, alice, bob, carol):
    """409 (a second POST) and 422 (a bad field, a body that is not JSON) on bob's key,
    and 404 for a key without settings, are attempts on bob's settings: recorded under
    bob with the staff account as actor, naming the key, never under carol or the caller."""
    bob_key = configured(bob, "bob")
    bare = api_key_issue(user=bob, name="bare")[0]
    url = f"{proxy_url}/v1/admin/tokens"
    body = {"key_id": bob_key.key_id, "upstream_base_url": "https://x.example", "upstream_api_key": "sk"}
    assert httpx.post(url, headers=staff, json=body).status_code == 409
    assert httpx.patch(f"{url}/{bob_key.key_id}", headers=staff, json={"memory_limit": 0}).status_code == 422
    assert httpx.put(f"{url}/{bob_key.key_id}", headers=staff, content=b"{").status_code == 422
    assert httpx.get(f"{url}/{bare.key_id}", headers=staff).status_code == 404
    assert httpx.patch(f"{url}/{bare.key_id}", headers=staff, json={"memory_limit": 3}).status_code == 404
    assert httpx.delete(f"{url}/{bare.key_id}", headers=staff).status_code == 404

    rows = staff_rows(alice)
    assert [(subject, outcome, code) for subject, outcome, code, _ in rows] == [
        (bob.pk, AuditEvent.Outcome.ERROR, "conflict"),
        (bob.pk, AuditEvent.Outcome.ERROR, "invalid_argument"),
        (bob.pk, AuditEvent.Outcome.ERROR, "invalid_argument"),
        (bob.pk, AuditEvent.Outcome.DENIED, "not_found"),
        (bob.pk, AuditEvent.Outcome.DENIED, "not_found"),
        (bob.pk, AuditEvent.Outcome.DENIED, "not_found"),
    ]
    assert [detail["key_id"] for *_, detail in rows] == [bob_key.key_id] * 3 + [bare.key_id] * 3
    assert caller_rows(alice) == []
    assert not AuditEvent.objects.filter(subject_user_id=carol.pk).exists()
    # Nothing changed.
    assert TokenConfig.objects.get(api_key=bob_key).memory_limit == 5


def test_a_403_is_audited_once(proxy_url, alice, alice_key, bob):
    """A 403 is recorded where it is decided (token_config_admin_authorize); the refusal
    path does not record it a second time. A PUT that would create needs `add` too."""
    from tests.test_proxy_admin_access import make_staff

    make_staff(alice, "change")
    bare = api_key_issue(user=bob, name="bare")[0]
    body = {"upstream_base_url": "https://x.example", "upstream_api_key": "sk"}
    response = httpx.put(
        f"{proxy_url}/v1/admin/tokens/{bare.key_id}", headers={"Authorization": f"Bearer {alice_key}"}, json=body
    )
    assert response.status_code == 403
    rows = AuditEvent.objects.filter(operation=Operation.PROXY_TOKEN_CONFIG)
    assert list(rows.values_list("error_code", "subject_user_id")) == [("forbidden", alice.pk)]
