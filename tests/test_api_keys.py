from io import StringIO

import pytest
from django.core.management import CommandError, call_command

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
