from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from memories.models import ApiKey
from memories.services import api_key_authenticate, api_key_issue, api_key_revoke

pytestmark = pytest.mark.django_db


def test_issue_api_key_prints_the_key_last_and_stores_only_a_hash(alice):
    out = StringIO()
    call_command("issue_api_key", "alice", stdout=out, stderr=StringIO())
    plain = out.getvalue().strip().splitlines()[-1]

    assert plain.startswith("msk_")
    key = ApiKey.objects.get(user=alice)
    assert plain.split("_", 2)[2] not in key.secret_hash
    assert api_key_authenticate(token=plain) == key


def test_create_user_flag(django_user_model):
    out = StringIO()
    with pytest.raises(CommandError, match="--create-user"):
        call_command("issue_api_key", "dora", stdout=out, stderr=StringIO())
    call_command("issue_api_key", "dora", "--create-user", stdout=out, stderr=StringIO())
    dora = django_user_model.objects.get(username="dora")
    assert api_key_authenticate(token=out.getvalue().strip().splitlines()[-1]).user == dora
    assert not dora.has_usable_password()


def test_wrong_revoked_and_malformed_keys_fail(alice, bob):
    key, plain = api_key_issue(user=alice)
    assert api_key_authenticate(token=plain[:-2] + "xx") is None
    assert api_key_authenticate(token="msk_" + key.key_id) is None
    assert api_key_authenticate(token="Bearer " + plain) is None
    assert api_key_authenticate(token="") is None

    assert api_key_revoke(user=bob, key_id=key.key_id) is False  # not bob's key
    assert api_key_authenticate(token=plain) == key
    assert api_key_revoke(user=alice, key_id=key.key_id) is True
    assert api_key_authenticate(token=plain) is None


def test_inactive_users_keys_fail(alice):
    _, plain = api_key_issue(user=alice)
    alice.is_active = False
    alice.save()
    assert api_key_authenticate(token=plain) is None


def test_last_used_is_recorded(alice):
    key, plain = api_key_issue(user=alice)
    assert key.last_used_at is None
    api_key_authenticate(token=plain)
    key.refresh_from_db()
    assert key.last_used_at is not None


def test_authenticate_loads_the_key_its_user_and_tenant_in_one_query(alice, django_assert_num_queries):
    """The key lookup is one hand-written statement (the ORM compiled a three-table select
    on every call): it must load exactly what select_related did."""
    from core.scope import user_tenant
    from memories.models import TenantMembership
    from memories.tenancy import tenant_create, tenant_user_create

    tenant_create(name="acme")
    olga = tenant_user_create(tenant="acme", username="olga")
    TenantMembership.objects.filter(user=alice).delete()  # a user from before tenants: the default tenant
    for user, tenant in ((olga, "acme"), (alice, "default")):
        key, plain = api_key_issue(user=user, name="agent", permissions=frozenset({"read"}))
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=timezone.now())  # no last-used write below
        expected = ApiKey.objects.select_related("user", "user__tenant_membership").get(pk=key.pk)
        with django_assert_num_queries(1):
            found = api_key_authenticate(token=plain)
            assert user_tenant(found.user) == tenant
            assert found.user.username == user.username and found.user.is_active
        assert {f.attname: getattr(found, f.attname) for f in ApiKey._meta.concrete_fields} == {
            f.attname: getattr(expected, f.attname) for f in ApiKey._meta.concrete_fields
        }
        assert {f.attname: getattr(found.user, f.attname) for f in found.user._meta.concrete_fields} == {
            f.attname: getattr(expected.user, f.attname) for f in expected.user._meta.concrete_fields
        }
        assert found.permission_set == frozenset({"read"})
