"""Review 19: operator commands check every argument before they change anything, answer a
bad one with a CommandError (no traceback), and never leave half of a change behind."""

from __future__ import annotations

import json
import sys
import threading
import uuid
from datetime import UTC, datetime, timedelta
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from audit.models import AuditEvent, AuditExportBatch
from core.errors import ErrorCode, ServiceError
from memories.models import ApiKey

# --- erasures --reapply-from: the whole list is checked before any erasure is applied ---------


def _erasure_of(user) -> dict:
    return {
        "id": str(uuid.uuid4()),
        "user_pk": user.pk,
        "engine_user_id": f"default:{user.pk}",
        "erased_at": (user.date_joined + timedelta(seconds=1)).isoformat(),
        "request_id": "",
    }


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors")
@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ({"user_pk": 99999999999999999999}, "user_pk out of range"),
        ({"user_pk": 2**63}, "user_pk out of range"),
        ({"user_pk": 0}, "user_pk out of range"),
        ({"user_pk": -4}, "user_pk out of range"),
        ({"user_pk": 4.0}, "bad or missing user_pk"),
        # Of a user not in the data: the entry's own values go into a ledger row.
        ({"user_pk": 10**12, "engine_user_id": "x" * 256}, "engine_user_id longer than 255 characters"),
        ({"user_pk": 10**12, "engine_user_id": "default:\u0000"}, "engine_user_id contains a NUL character"),
        ({"user_pk": 10**12, "request_id": "\ud800"}, "request_id is not valid Unicode"),
        ({"engine_user_id": "x" * 256}, "engine_user_id longer than 255 characters"),
        ({"request_id": 7}, "bad request_id"),
        ({"erased_at": "0001-01-01T00:00:00+01:00"}, "erased_at out of range"),
        ({"erased_at": 20260101}, "bad or missing erased_at"),
        ({"id": 5}, "bad or missing id"),
    ],
)
def test_reapply_from_refuses_a_bad_entry_before_applying_the_good_one_before_it(
    settings, tmp_path, alice, bad, problem
):
    from memories.toolkit.models import Decision
    from memsite.models import ErasureLedger

    settings.BACKUP_ENABLED = False
    Decision.objects.create(user_id=alice.pk, key="k", value="v", created_at=timezone.now(), updated_at=timezone.now())
    good = _erasure_of(alice)
    after = (alice.date_joined - timedelta(days=1)).isoformat()
    listing = tmp_path / "erasures.jsonl"
    # A blank line: the message names the file's line, not only the entry's number.
    listing.write_text(json.dumps(good) + "\n\n" + json.dumps({**_erasure_of(alice), **bad}) + "\n")
    with pytest.raises(CommandError, match=f"line 3: erasure entry 2: {problem}"):
        call_command("erasures", "--reapply-from", str(listing), "--after", after, stdout=StringIO())
    # Nothing applied: alice's data and an empty ledger.
    assert Decision.objects.filter(user_id=alice.pk).exists()
    assert not ErasureLedger.objects.exists()

    # The good entry alone goes through (the checks refuse only what is wrong).
    listing.write_text(json.dumps(good) + "\n")
    out = StringIO()
    call_command("erasures", "--reapply-from", str(listing), "--after", after, stdout=out)
    assert "1 re-applied" in out.getvalue()
    assert not Decision.objects.filter(user_id=alice.pk).exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("line", "problem"),
    [("{not json", "not a JSON value \\(JSONDecodeError\\)"), ("[" * 100_000, "not a JSON value \\(RecursionError\\)")],
)
def test_reapply_from_names_the_line_that_is_not_json(tmp_path, alice, line, problem):
    listing = tmp_path / "erasures.jsonl"
    listing.write_text(json.dumps(_erasure_of(alice)) + "\n" + line + "\n")
    with pytest.raises(CommandError, match=f"line 2: {problem}"):
        call_command("erasures", "--reapply-from", str(listing), "--after", "2020-01-01T00:00:00+00:00")


# --- issue_api_key and create_account: no user created for a key that cannot be issued ---------


def _usernames() -> set[str]:
    return set(get_user_model().objects.values_list("username", flat=True))


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nobody", "--expires", "2000-01-01"], "--expires must be in the future"),
        (["nobody", "--expires", "0h"], "--expires must be in the future"),
        (["nobody", "--expires", "9999-12-31T23:59:59-05:00"], "--expires is out of range"),
        (["", "--expires", "30d"], "A username cannot be empty"),
        ([""], "A username cannot be empty"),
        (["u" * 200], "A username is at most 150 characters"),
        (["bad user/with space"], "Username 'bad user/with space': Enter a valid username"),
        (["nobody", "--tenant", "Bad Tenant!"], "tenant name"),
    ],
)
def test_issue_api_key_checks_every_argument_before_creating_the_user(args, message):
    before = _usernames()
    err = StringIO()
    with pytest.raises(CommandError, match=message):
        call_command("issue_api_key", *args, "--create-user", stdout=StringIO(), stderr=err)
    assert _usernames() == before
    assert not ApiKey.objects.exists()
    assert "created user" not in err.getvalue()


@pytest.mark.django_db
def test_issue_api_key_creates_the_user_and_the_key_in_one_transaction(monkeypatch):
    """Whatever fails at the key (here: the service refuses it), the user goes too."""
    from memories.management.commands import issue_api_key

    def refuse(**kwargs):
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "refused")

    monkeypatch.setattr(issue_api_key, "api_key_issue", refuse)
    err = StringIO()
    with pytest.raises(CommandError, match="refused"):
        call_command("issue_api_key", "nobody", "--create-user", stdout=StringIO(), stderr=err)
    assert not get_user_model().objects.filter(username="nobody").exists()
    assert "created user" not in err.getvalue()


@pytest.mark.django_db
def test_issue_api_key_still_issues_to_an_existing_user_whose_name_the_validator_would_refuse():
    """OIDC takes preferred_username as it comes: such a user can still get a key."""
    user = get_user_model().objects.create_user(username="Ann Smith")
    out = StringIO()
    call_command("issue_api_key", "Ann Smith", "--create-user", stdout=out, stderr=StringIO())
    assert ApiKey.objects.get(user=user).key_id in out.getvalue()


@pytest.mark.django_db
def test_tenant_user_create_answers_a_bad_or_taken_username_with_a_coded_error(alice):
    from memories.tenancy import tenant_user_create

    for username in ("", "x" * 151, "no spaces", "a/b"):
        with pytest.raises(ServiceError) as caught:
            tenant_user_create(tenant="default", username=username)
        assert caught.value.code == ErrorCode.INVALID_ARGUMENT
    with pytest.raises(ServiceError) as caught:
        tenant_user_create(tenant="default", username="alice")
    assert caught.value.code == ErrorCode.CONFLICT


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([""], "A username cannot be empty"),
        (["bad user/with space"], "Enter a valid username"),
        (["u" * 200], "A username is at most 150 characters"),
        (["carol", "--email", "not-an-address"], "--email: Enter a valid email address"),
        (["carol", "--email", "a" * 250 + "@example.com"], "--email is at most 254 characters"),
    ],
)
def test_create_account_refuses_bad_arguments_before_asking_for_a_password(monkeypatch, args, message):
    stdin = StringIO("Correct-horse-battery-9\n")
    monkeypatch.setattr(sys, "stdin", stdin)
    before = _usernames()
    with pytest.raises(CommandError, match=message):
        call_command("create_account", *args, "--password-stdin", stdout=StringIO())
    assert _usernames() == before
    assert stdin.tell() == 0  # not asked for


@pytest.mark.django_db
def test_create_account_still_creates_a_good_account(monkeypatch):
    monkeypatch.setattr(sys, "stdin", StringIO("Correct-horse-battery-9\n"))
    call_command("create_account", "carol", "--email", "carol@example.com", "--password-stdin", stdout=StringIO())
    assert get_user_model().objects.get(username="carol").check_password("Correct-horse-battery-9")


# --- export_audit: a bad batch size, progress, storage and lock failures -----------------------


@pytest.fixture
def audit_storage(settings, tmp_path):
    settings.STORAGES = {
        **settings.STORAGES,
        "audit": {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": tmp_path / "a"}},
    }
    settings.AUDIT_EXPORT_LAG_S = 0
    old = timezone.now() - timedelta(minutes=1)
    AuditEvent.objects.bulk_create(
        AuditEvent(request_id=f"req-{i}", channel="mcp", operation="remember", outcome="ok", occurred_at=old)
        for i in range(5)
    )
    return tmp_path / "a"


@pytest.mark.django_db
@pytest.mark.parametrize("size", ["-5", "0"])
def test_export_audit_refuses_a_batch_size_below_one(audit_storage, size):
    with pytest.raises(CommandError, match="--batch-size must be at least 1"):
        call_command("export_audit", "--batch-size", size, stdout=StringIO())
    assert not AuditExportBatch.objects.exists()


@pytest.mark.django_db
def test_export_audit_shows_progress_batch_by_batch(audit_storage):
    pending = AuditEvent.objects.count()
    out = StringIO()
    call_command("export_audit", "--batch-size", "2", stdout=out)
    lines = out.getvalue().splitlines()
    batches = -(-pending // 2)
    assert len(lines) == batches + 1
    assert lines[0].startswith("batch 1: ") and lines[0].endswith(", 2 rows exported so far")
    assert lines[batches - 1].endswith(f", {pending} rows exported so far")
    assert lines[-1].startswith(f"exported {pending} rows in {batches} batches")


@pytest.mark.django_db
def test_export_audit_turns_a_storage_failure_into_a_command_error(audit_storage):
    audit_storage.write_text("a file where the export's folder should be")
    with pytest.raises(CommandError, match=r"audit export stopped: storage failed on 0+\d+-0+\d+\.jsonl\.gz: \w+Error"):
        call_command("export_audit", stdout=StringIO())
    assert not AuditExportBatch.objects.exists()  # the watermark did not move


@pytest.mark.django_db(transaction=True)
def test_export_audit_says_so_when_another_export_holds_the_lock(audit_storage):
    from core.locks import advisory_lock

    held, release = threading.Event(), threading.Event()

    def other_export():
        try:
            with advisory_lock("audit-export"):
                held.set()
                release.wait(30)
        finally:
            connection.close()

    thread = threading.Thread(target=other_export)
    thread.start()
    try:
        assert held.wait(30)
        with pytest.raises(CommandError, match="another audit export is running"):
            call_command("export_audit", stdout=StringIO())
    finally:
        release.set()
        thread.join(30)
    assert not AuditExportBatch.objects.exists()
    call_command("export_audit", stdout=StringIO())  # once it is done, the export runs
    assert AuditExportBatch.objects.exists()


def test_expiry_parse_keeps_utc():
    from memories.management.commands.issue_api_key import parse_expiry

    assert parse_expiry("2999-01-01T12:00:00+02:00") == datetime(2999, 1, 1, 10, tzinfo=UTC)
