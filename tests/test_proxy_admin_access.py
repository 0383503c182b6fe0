"""Review rev004: who may use the chat proxy's admin token API (`/v1/admin/tokens`), and
the shape of its (and the chat route's) 405. A staff account's key needs the key's own
permission (read to list or show, write to create or change, delete to delete) and the
staff account's Django model permission on TokenConfig, as in the admin."""

from __future__ import annotations

import httpx
import pytest
from django.contrib.auth.models import Permission as DjangoPermission

from audit.models import AuditEvent
from core.choices import Operation, Permission
from memories.services import api_key_issue
from proxy.models import TokenConfig
from proxy.services import token_config_save
from tests.conftest import internal_call, serve_in_thread

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

ALL_TOKENCONFIG = ("view", "add", "change", "delete")


@pytest.fixture(scope="module")
def proxy_url(django_db_setup):  # noqa: ARG001 - the server uses the test database
    yield from serve_in_thread("memsite.asgi:build_application", factory=True, lifespan="on")


def make_staff(user, *actions: str) -> None:
    user.is_staff = True
    user.save()
    codenames = [f"{action}_tokenconfig" for action in actions]
    user.user_permissions.set(DjangoPermission.objects.filter(content_type__app_label="proxy", codename__in=codenames))


def bob_config(bob) -> TokenConfig:
    api_key, _ = api_key_issue(user=bob, name="bob-chat")
    fields = {"upstream_base_url": "https://api.bob.example", "upstream_api_key": "sk-bob"}
    token_config_save(api_key=api_key, fields=fields, partial=False, call=internal_call())
    return TokenConfig.objects.get(api_key=api_key)


def denials() -> list[tuple[str, str, int | None]]:
    rows = AuditEvent.objects.filter(operation=Operation.PROXY_TOKEN_CONFIG, outcome=AuditEvent.Outcome.DENIED)
    return list(rows.values_list("error_code", "actor_username", "subject_user_id"))


def assert_forbidden(response: httpx.Response) -> None:
    assert response.status_code == 403, response.text
    assert response.headers["x-memsite-error"] == "forbidden"
    error = response.json()["error"]
    assert error["code"] == "forbidden" and error["type"] == "memsite_error" and "param" in error


def test_readonly_staff_key_rewrites_another_users_upstream(proxy_url, alice, bob):
    """A staff user's read-only key could create, replace, patch and delete any user's
    upstream (where that user's prompts and memories go)."""
    make_staff(alice, *ALL_TOKENCONFIG)
    _, ro_key = api_key_issue(user=alice, name="ro", permissions=frozenset({Permission.READ}))
    staff = {"Authorization": f"Bearer {ro_key}"}
    bob_key_id = api_key_issue(user=bob)[0].key_id
    body = {"key_id": bob_key_id, "upstream_base_url": "https://attacker.example", "upstream_api_key": "sk-x"}
    assert_forbidden(httpx.post(f"{proxy_url}/v1/admin/tokens", headers=staff, json=body))
    assert not TokenConfig.objects.exists()

    row = bob_config(bob)
    url = f"{proxy_url}/v1/admin/tokens/{row.api_key.key_id}"
    whole = {"upstream_base_url": "https://attacker.example", "upstream_api_key": "sk-x"}
    assert_forbidden(httpx.put(url, headers=staff, json=whole))
    assert_forbidden(httpx.patch(url, headers=staff, json={"upstream_base_url": "https://attacker.example"}))
    assert_forbidden(httpx.delete(url, headers=staff))
    row.refresh_from_db()
    assert row.upstream_base_url == "https://api.bob.example"
    # Each refusal is audited as denied, under the caller's own scope, naming the caller.
    assert denials() == [("forbidden", alice.username, alice.pk)] * 4
    # Reading is what a read key is for.
    assert httpx.get(f"{proxy_url}/v1/admin/tokens", headers=staff).status_code == 200
    assert httpx.get(url, headers=staff).json()["upstream_base_url"] == "https://api.bob.example"


def test_a_staff_key_without_read_cannot_list_or_show(proxy_url, alice, bob):
    make_staff(alice, *ALL_TOKENCONFIG)
    _, write_key = api_key_issue(user=alice, name="w", permissions=frozenset({Permission.WRITE}))
    staff = {"Authorization": f"Bearer {write_key}"}
    row = bob_config(bob)
    listed = httpx.get(f"{proxy_url}/v1/admin/tokens", headers=staff)
    assert_forbidden(listed)
    assert "api.bob.example" not in listed.text
    assert_forbidden(httpx.get(f"{proxy_url}/v1/admin/tokens/{row.api_key.key_id}", headers=staff))
    assert len(denials()) == 2


def test_delete_needs_the_delete_permission(proxy_url, alice, bob):
    make_staff(alice, *ALL_TOKENCONFIG)
    _, rw_key = api_key_issue(user=alice, name="rw", permissions=frozenset({Permission.READ, Permission.WRITE}))
    row = bob_config(bob)
    url = f"{proxy_url}/v1/admin/tokens/{row.api_key.key_id}"
    assert_forbidden(httpx.delete(url, headers={"Authorization": f"Bearer {rw_key}"}))
    assert TokenConfig.objects.filter(pk=row.pk).exists()
    _, full_key = api_key_issue(user=alice, name="full")
    assert httpx.delete(url, headers={"Authorization": f"Bearer {full_key}"}).status_code == 204


def test_a_staff_account_needs_its_model_permission(proxy_url, alice, alice_key, bob):
    """Staff status alone is the admin's login, not what it may do there: as in the admin,
    the account's group or user permissions on TokenConfig decide."""
    auth = {"Authorization": f"Bearer {alice_key}"}
    row = bob_config(bob)
    url = f"{proxy_url}/v1/admin/tokens/{row.api_key.key_id}"
    whole = {"upstream_base_url": "https://elsewhere.example", "upstream_api_key": "sk-y"}
    make_staff(alice)
    assert_forbidden(httpx.get(f"{proxy_url}/v1/admin/tokens", headers=auth))
    assert_forbidden(httpx.put(url, headers=auth, json=whole))
    make_staff(alice, "view")
    assert httpx.get(url, headers=auth).status_code == 200
    refused = httpx.patch(url, headers=auth, json={"memory_limit": 7})
    assert_forbidden(refused)
    assert "proxy.change_tokenconfig" in refused.json()["error"]["message"]
    make_staff(alice, "change")  # change lets it view too
    assert httpx.get(url, headers=auth).status_code == 200
    assert httpx.patch(url, headers=auth, json={"memory_limit": 7}).json()["memory_limit"] == 7
    # A PUT that would create a configuration is an add.
    other = api_key_issue(user=bob, name="other")[0].key_id
    assert_forbidden(httpx.put(f"{proxy_url}/v1/admin/tokens/{other}", headers=auth, json=whole))
    assert_forbidden(httpx.delete(url, headers=auth))
    make_staff(alice, "change", "add")
    assert httpx.put(f"{proxy_url}/v1/admin/tokens/{other}", headers=auth, json=whole).status_code == 200
    row.refresh_from_db()
    assert row.upstream_base_url == "https://api.bob.example" and row.memory_limit == 7
    # A superuser holds every permission.
    alice.user_permissions.clear()
    alice.is_superuser = True
    alice.save()
    assert httpx.delete(url, headers=auth).status_code == 204


def test_a_non_staff_key_is_refused_and_audited(proxy_url, bob, bob_key):
    response = httpx.get(f"{proxy_url}/v1/admin/tokens", headers={"Authorization": f"Bearer {bob_key}"})
    assert_forbidden(response)
    assert denials() == [("forbidden", bob.username, bob.pk)]


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/chat/completions", "POST"),
        ("DELETE", "/v1/admin/tokens", "GET, POST"),
        ("POST", "/v1/admin/tokens/some-key", "GET, PUT, PATCH, DELETE"),
    ],
)
def test_405_error_shape(proxy_url, alice_key, method, path, allow):
    response = httpx.request(method, f"{proxy_url}{path}", headers={"Authorization": f"Bearer {alice_key}"})
    assert response.status_code == 405
    assert response.headers["allow"] == allow
    assert response.headers["x-memsite-error"] == "method_not_allowed"
    error = response.json()["error"]
    assert error["code"] == "method_not_allowed" and error["type"] == "memsite_error" and error["param"] is None
    assert error["message"].startswith("Use ")
