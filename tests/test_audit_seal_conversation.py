"""Migration audit.0015: conversation ids that store_memory wrote into audit details in
plain text (before they were a content key) are sealed, or marked erased when their user
was erased since."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from audit.crypto import ERASED, content_open, is_sealed
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
    assert "joe" not in str(bob_detail) and bob_detail["stm"] == 1
    assert is_sealed(bob_detail["content"])
    assert content_open(bob_detail["content"]) == {
        "conversation_id": "call-with-jane.doe@example.com".replace("jane", "joe")
    }
    alice_detail = AuditEvent.objects.get(pk=alice_before_wipe).detail
    assert alice_detail["conversation_id"] == ERASED and "content" not in alice_detail
    # The append-only trigger is back in force.
    with pytest.raises(Exception, match="append-only"), connection.cursor() as cursor:
        cursor.execute("UPDATE audit_auditevent SET detail = '{}' WHERE id = %s", [bob_row])
