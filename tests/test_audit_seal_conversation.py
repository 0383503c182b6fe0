"""Migrations audit.0015 and 0016: conversation ids (store_memory), session names and
projects (the lifecycle tools, the proxy) that were written into audit details in plain text
before they were content keys are sealed, or marked erased when their user was erased
since."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from audit.crypto import ERASED, content_open, content_seal, is_sealed
from audit.models import AuditEvent

pytestmark = [pytest.mark.django_db(transaction=True)]

INSERT = (
    "INSERT INTO audit_auditevent (occurred_at, request_id, channel, operation, outcome, error_code,"
    " actor_username, actor_auth, actor_client_app, actor_role, staff_username, tenant, subject_user_id,"
    " memory_ids, detail, user_agent, turn_id, turn_event) VALUES (now(), %s, 'mcp', %s, 'ok', '', %s,"
    " 'api_key', '', 'user', '', 'default', %s, '[]', %s, '', '', '') RETURNING id"
)


def _row(user, operation: str, detail: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(INSERT, [f"old-{operation}-{user.pk}", operation, user.username, user.pk, detail])
        return cursor.fetchone()[0]


def test_plain_conversation_ids_are_sealed_or_marked_erased(alice, bob):
    executor = MigrationExecutor(connection)
    executor.migrate([("audit", "0014_history_owner_index")])
    stored = '{"conversation_id": "call-with-jane.doe@example.com", "stm": 1, "ltm_candidates": 0}'
    alice_before_wipe = _row(alice, "store_memory", stored)
    _row(alice, "wipe_user_data", '{"memories": 1}')
    bob_row = _row(bob, "store_memory", stored.replace("jane", "joe"))

    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())

    bob_detail = AuditEvent.objects.get(pk=bob_row).detail
    # Needles hold a "." or "-", which base64 ciphertext never does: no match by chance.
    assert "joe.doe" not in str(bob_detail) and bob_detail["stm"] == 1
    assert is_sealed(bob_detail["content"])
    assert content_open(bob_detail["content"]) == {
        "conversation_id": "call-with-jane.doe@example.com".replace("jane", "joe")
    }
    alice_detail = AuditEvent.objects.get(pk=alice_before_wipe).detail
    assert alice_detail["conversation_id"] == ERASED and "content" not in alice_detail
    # The append-only trigger is back in force.
    with pytest.raises(Exception, match="append-only"), connection.cursor() as cursor:
        cursor.execute("UPDATE audit_auditevent SET detail = '{}' WHERE id = %s", [bob_row])


def test_plain_session_names_and_projects_are_sealed_into_the_rows_envelope(alice, bob):
    executor = MigrationExecutor(connection)
    executor.migrate([("audit", "0015_seal_conversation_ids")])
    names = {"project": "divorce-lawyer-search", "session_id": "jane-doe-custody"}
    plain_only = _row(alice, "memory_before_turn", json.dumps({**names, "injected": 2}))
    # An export's row already had its path sealed; the names join that one envelope.
    envelope = content_seal({"path": "/exports/jane.jsonl"}, subject_user_id=alice.pk)
    with_envelope = _row(alice, "memory_export_session", json.dumps({**names, "entries": 3, "content": envelope}))
    bob_before_wipe = _row(bob, "memory_after_turn", json.dumps(names))
    _row(bob, "wipe_user_data", '{"memories": 1}')

    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())

    detail = AuditEvent.objects.get(pk=plain_only).detail
    assert "jane-" not in str(detail) and "divorce-" not in str(detail) and detail["injected"] == 2
    assert content_open(detail["content"]) == names
    detail = AuditEvent.objects.get(pk=with_envelope).detail
    assert "jane." not in str(detail) and "jane-" not in str(detail) and detail["entries"] == 3
    assert content_open(detail["content"]) == {"path": "/exports/jane.jsonl", **names}
    detail = AuditEvent.objects.get(pk=bob_before_wipe).detail
    assert detail == {"project": ERASED, "session_id": ERASED}
