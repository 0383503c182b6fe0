"""The audit trail under the documented two-role deployment (docs/operations.md, "Two
database roles"): the app's role does not own the tables, so it can neither TRUNCATE nor
DISABLE TRIGGER, and the append-only triggers check, in the database, what makes a
delete or a redaction legitimate: a session variable alone opens nothing."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from audit.export import audit_retention_purge
from audit.models import AuditEvent, AuditExportBatch, MemoryHistory
from memories.auth import Principal
from memories.operations import operation_execute
from memories.services import memory_remember
from tests.conftest import internal_call

pytestmark = pytest.mark.django_db

OPERATIONS_DOC = Path(__file__).resolve().parent.parent / "docs" / "operations.md"


def _documented_grants() -> list[str]:
    """The statements the owner runs after `migrate`, as docs/operations.md gives them."""
    text = OPERATIONS_DOC.read_text()
    block = re.search(r"<!-- app-role-grants -->\n```sql\n(.*?)```", text, re.S)
    assert block, "docs/operations.md lost its app role grants block"
    lines = [line for line in block.group(1).splitlines() if line and not line.startswith("--")]
    return " ".join(lines).replace(";", ";\n").split("\n")[:-1]


@pytest.fixture
def app_role() -> Iterator[str]:
    """A role made as the documented app role, the test's connection (the tables' owner)
    being the owner role; LOGIN left out: the test switches to it with SET ROLE. Roles
    are the cluster's: one name per test database (xdist workers have their own)."""
    name = f"{connection.settings_dict['NAME']}_app"[:63]
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_user")
        owner = cursor.fetchone()[0]
        cursor.execute(f'CREATE ROLE "{name}" NOSUPERUSER NOCREATEROLE NOCREATEDB NOLOGIN')
        for statement in _documented_grants():
            statement = statement.replace("memsite_app", f'"{name}"').replace("memsite_owner", f'"{owner}"')
            cursor.execute(statement)
    yield name
    with connection.cursor() as cursor:
        cursor.execute(f'DROP OWNED BY "{name}"; DROP ROLE "{name}"')


@contextmanager
def acting_as(role: str) -> Iterator[None]:
    """The app's own connection, as the app role, until the block ends (a refused
    statement rolls back its savepoint, and the role change with it)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f'SET ROLE "{role}"')
        yield
        cursor.execute("RESET ROLE")


def refused(statement: str, params: list | None = None, match: str = "") -> str:
    with pytest.raises(DatabaseError, match=match) as caught, transaction.atomic():
        connection.cursor().execute(statement, params)
    return str(caught.value)


def _audit_row(**fields) -> AuditEvent:
    return AuditEvent.objects.create(
        request_id="r-orig", channel="mcp", operation="delete_memory", outcome="ok", subject_user_id=7,
        memory_ids=["m-1"], detail={"why": "original"}, **fields,
    )  # fmt: skip


def _export_up_to(row: AuditEvent) -> None:
    watermark = max(AuditExportBatch.objects.values_list("last_id", flat=True), default=0)
    AuditExportBatch.objects.create(
        first_id=watermark + 1, last_id=row.pk, row_count=1, sha256="x", object_key="k", manifest_key="m"
    )


def test_the_app_role_can_neither_truncate_nor_disable_the_triggers(app_role):
    with acting_as(app_role):
        cursor = connection.cursor()
        cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        assert cursor.fetchone()[0] is False
        for table in ("audit_auditevent", "audit_memoryhistory", "audit_auditexportbatch", "memsite_audit_policy"):
            refused(f"SET LOCAL memsite.audit_allow_truncate = 'on'; TRUNCATE {table}", match="permission denied")
            refused(f"ALTER TABLE {table} DISABLE TRIGGER ALL", match="must be owner")
        # The retention floor is the owner's to set, whatever is granted on it.
        refused("UPDATE memsite_audit_policy SET retention_floor = interval '1 day'", match="owner only")
    # Even a role granted TRUNCATE is refused by the trigger: only the owner empties a table.
    with connection.cursor() as cursor:
        cursor.execute(f'GRANT TRUNCATE ON audit_auditevent TO "{app_role}"')
    with acting_as(app_role):
        refused("SET LOCAL memsite.audit_allow_truncate = 'on'; TRUNCATE audit_auditevent", match="append-only")


def test_the_app_role_cannot_delete_an_unexported_or_recent_audit_row_nor_replace_one(app_role):
    two_days_ago = timezone.now() - timedelta(days=2)
    unexported = _audit_row(occurred_at=two_days_ago)
    _export_up_to(unexported)
    old = _audit_row(occurred_at=two_days_ago)
    recent = _audit_row()
    _export_up_to(recent)
    tail = _audit_row(occurred_at=two_days_ago)  # old, after the watermark
    retention = "SET LOCAL memsite.audit_retention = 'on'; "
    with acting_as(app_role):
        refused(retention + "DELETE FROM audit_auditevent WHERE id = %s", [tail.pk], match="not exported yet")
        refused(retention + "DELETE FROM audit_auditevent WHERE id = %s", [recent.pk], match="retention floor")
        refused(retention + "DELETE FROM audit_auditevent", match="append-only")
        refused("UPDATE audit_auditevent SET operation = 'search_memory'", match="permission denied")
        # The watermark only moves forward, to a recorded row, and is never rewritten.
        refused(
            "INSERT INTO audit_auditexportbatch (first_id, last_id, row_count, sha256, object_key, manifest_key,"
            " exported_at) VALUES (%s, %s, 1, 'x', 'k', 'm', now())",
            [tail.pk + 1, tail.pk + 1_000_000],
            match="do not follow the watermark",
        )
        refused("DELETE FROM audit_auditexportbatch", match="permission denied")
        # An exported row, once deleted by retention, cannot come back as another.
        assert audit_retention_purge(older_than_days=1) == 2
        assert set(AuditEvent.objects.values_list("pk", flat=True)) == {recent.pk, tail.pk}
        refused(
            "INSERT INTO audit_auditevent (id, occurred_at, request_id, channel, operation, outcome, error_code,"
            " actor_username, actor_auth, actor_client_app, actor_credential, actor_role, staff_username, tenant,"
            " subject_user_id, memory_ids, detail, user_agent, turn_id, turn_event)"
            " SELECT %s, now(), 'r-orig', 'mcp', 'search_memory', 'ok', '', '', '', '', '', '', '', '', 7,"
            " '[]'::jsonb, '{}'::jsonb, '', '', ''",
            [old.pk],
            match="already exported",
        )
    assert not AuditEvent.objects.filter(pk__in=[unexported.pk, old.pk]).exists()


def test_the_app_role_cannot_blank_or_delete_a_live_memorys_history(app_role, alice, alice_scope):
    with acting_as(app_role):
        memory_id = memory_remember(alice_scope, memory="Alice's locker code is 4711", call=internal_call()).id
        redact = "SET LOCAL memsite.history_redact = 'on'; "
        retention = "SET LOCAL memsite.audit_retention = 'on'; "
        blank = "UPDATE audit_memoryhistory SET old_memory = NULL, new_memory = NULL WHERE memory_id = %s"
        refused(redact + blank, [memory_id], match="still exists")
        refused(retention + "DELETE FROM audit_memoryhistory WHERE memory_id = %s", [memory_id], match="still exists")
    assert MemoryHistory.objects.get(memory_id=memory_id).new_memory == "Alice's locker code is 4711"


@pytest.mark.django_db(transaction=True)  # the engine reads what is committed
def test_a_deleted_memorys_history_goes_only_with_its_owners_erasure(app_role, alice, alice_scope, settings):
    settings.TRASH_RETENTION_DAYS = 0  # deleted for good at once
    principal = _principal(alice)
    with acting_as(app_role):
        memory_id = memory_remember(alice_scope, memory="Alice's PIN is 2468", call=internal_call()).id
        kept = memory_remember(alice_scope, memory="Alice likes plums", call=internal_call()).id
    with acting_as(app_role):
        operation_execute(principal, "delete_memory", {"memory_id": memory_id}, call=internal_call())
    # The purge blanked the texts (a legitimate redaction, as the app role) ...
    assert set(MemoryHistory.objects.filter(memory_id=memory_id).values_list("new_memory", flat=True)) == {None}
    with acting_as(app_role):
        # ... but its events stay while the owner is not erased.
        retention = "SET LOCAL memsite.audit_retention = 'on'; "
        statement = retention + "DELETE FROM audit_memoryhistory WHERE memory_id = %s"
        refused(statement, [memory_id], match="is not erased")
    assert MemoryHistory.objects.filter(memory_id=memory_id).exists()
    with acting_as(app_role):
        # The erasure, as the app role, deletes every version.
        result = operation_execute(principal, "wipe_user_data", {"confirm": True}, call=internal_call())
    assert result["memories_deleted"] == 1
    assert not MemoryHistory.objects.filter(memory_id__in=[memory_id, kept]).exists()


def _principal(user) -> Principal:
    return Principal(user=user, method="api_key", client_app="roles-test")
