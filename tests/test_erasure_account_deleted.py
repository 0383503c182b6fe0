"""A restore must not bring a deleted account back. Deleting a user in the admin erases their
data and deletes the account; the erasure ledger's record (and the audit trail's list, for
an external database) said only "erasure of user N", so re-applying it after a restore to
before the deletion wiped the data but left the restored account, with its password and
working API keys."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from audit.models import AuditEvent
from core.choices import Operation
from core.scope import MemoryScope
from memories.auth import authenticate_bearer
from memories.models import ApiKey, TenantMembership
from memories.services import api_key_issue, memory_remember
from memories.tenancy import tenant_create, tenant_user_create
from memsite.models import ErasureLedger
from memsite.services import (
    ErasureEntryInvalid,
    erasure_entries_check,
    erasure_ledger_write,
    erasures_from_audit,
    erasures_reapply,
)
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


@pytest.fixture
def ledger_on(settings, tmp_path, monkeypatch):
    from memsite import services

    settings.BACKUP_DIR = tmp_path / "backups"
    settings.BACKUP_ENABLED = True
    settings.EMBEDDED_DATABASE = True
    monkeypatch.setattr(services, "erasure_ledger_write_task", SimpleNamespace(delay=lambda ledger_id: None))
    return settings


def _user_with_a_key(username: str):
    tenant_create(name="acme")
    user = tenant_user_create(tenant="acme", username=username)
    _, secret = api_key_issue(user=user, name=f"{username}-agent")
    memory_remember(MemoryScope.for_user(user), memory=f"{username}'s locker code is 4711", call=internal_call())
    return user, secret


class Snapshot:
    """The account's rows as a backup from before the deletion holds them."""

    def __init__(self, user):
        self.model = type(user)
        self.user = self.model.objects.filter(pk=user.pk).values().get()
        self.keys = list(ApiKey.objects.filter(user_id=user.pk).values())
        self.membership = TenantMembership.objects.filter(user_id=user.pk).values().get()

    def restore(self) -> None:
        self.model.objects.create(**self.user)
        ApiKey.objects.bulk_create([ApiKey(**row) for row in self.keys])
        TenantMembership.objects.create(**self.membership)


def test_a_restore_deletes_again_an_account_the_admin_deleted(ledger_on, admin_client):
    from memsite import backup

    ann, secret = _user_with_a_key("ann")
    before = Snapshot(ann)
    assert admin_client.post(f"/admin/auth/user/{ann.pk}/delete/", {"post": "yes"}).status_code == 302
    row = ErasureLedger.objects.get(user_pk=ann.pk)
    erasure_ledger_write(ledger_id=str(row.id))
    records = backup.erasure_records()

    # The restored data: the account and its key are back, the erasure's row is not.
    ErasureLedger.objects.all().delete()
    before.restore()
    assert authenticate_bearer(f"Bearer {secret}") is not None
    mark = AuditEvent.objects.order_by("-id").values_list("id", flat=True).first()

    report = erasures_reapply(entries=records, after=None)

    assert report.reapplied == 1
    assert not type(ann).objects.filter(pk=ann.pk).exists()
    assert not ApiKey.objects.filter(user_id=ann.pk).exists()
    assert authenticate_bearer(f"Bearer {secret}") is None
    rows = AuditEvent.objects.filter(id__gt=mark).order_by("id")
    assert [(r.operation, r.actor_username, r.request_id, r.subject_user_id) for r in rows] == [
        (Operation.ERASURE_REAPPLY, "system:restore", row.request_id, ann.pk),
        (Operation.ADMIN_DELETE_USER, "system:restore", row.request_id, ann.pk),
    ]
    # The record says so, and so does the re-applied erasure's row.
    assert [r.get("account_deleted") for r in records] == [True]
    assert ErasureLedger.objects.get(id=row.id).account_deleted
    # A second run finds it done.
    assert erasures_reapply(entries=records, after=None).already_in_data == 1


def test_the_audit_trail_lists_which_erasures_deleted_the_account(settings, admin_client):
    from memories.toolkit.services import toolkit_user_data_wipe

    settings.BACKUP_ENABLED = False  # no ledger: the operator keeps the audit trail's list
    since = datetime.now(UTC) - timedelta(seconds=1)
    ann, ann_secret = _user_with_a_key("ann")
    bob = tenant_user_create(tenant="acme", username="bob")
    _, bob_secret = api_key_issue(user=bob, name="bob-agent")
    ann_before = Snapshot(ann)
    toolkit_user_data_wipe(MemoryScope.for_user(bob), confirm=True, call=internal_call())  # keeps the account
    assert admin_client.post(f"/admin/auth/user/{ann.pk}/delete/", {"post": "yes"}).status_code == 302

    records = erasures_from_audit(since=since)

    ann_before.restore()
    report = erasures_reapply(entries=records, after=since)
    assert report.reapplied == 2
    assert authenticate_bearer(f"Bearer {ann_secret}") is None
    assert not type(ann).objects.filter(pk=ann.pk).exists()
    assert authenticate_bearer(f"Bearer {bob_secret}") is not None  # his erasure kept his account
    assert [(r["user_pk"], r.get("account_deleted")) for r in records] == [(bob.pk, False), (ann.pk, True)]
    # Listed again, the re-application says the same.
    again = {r["user_pk"]: r["account_deleted"] for r in erasures_from_audit(since=since)}
    assert again == {bob.pk: False, ann.pk: True}


def test_a_record_from_before_the_flag_keeps_the_account_and_a_bad_flag_is_refused(ledger_on):
    ann, secret = _user_with_a_key("ann")
    old = {
        "id": str(uuid.uuid4()),
        "user_pk": ann.pk,
        "engine_user_id": f"acme:{ann.pk}",
        "erased_at": (ann.date_joined + timedelta(seconds=1)).isoformat(),
        "request_id": "",
    }
    with pytest.raises(ErasureEntryInvalid, match="bad account_deleted"):
        erasure_entries_check([{**old, "account_deleted": "yes"}])
    assert erasures_reapply(entries=[old], after=None).reapplied == 1
    assert authenticate_bearer(f"Bearer {secret}") is not None
    assert not ErasureLedger.objects.get(id=old["id"]).account_deleted
