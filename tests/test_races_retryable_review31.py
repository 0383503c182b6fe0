"""Races a caller did not cause answer `resource_busy` with `retry_after_s`, never
`conflict` (which tells a client not to retry: a reused id, a text another memory has).
Two were left answering `conflict` after the lock waits were made retryable: an update
whose memory kept moving while it waited, and an import a concurrent store of one of its
texts rolled back."""

from __future__ import annotations

import json
from itertools import count

import pytest

from core.errors import ErrorCode, ServiceError
from memories import services
from memories.services import memory_import_file, memory_list, memory_remember, memory_update
from tests.conftest import InThread, internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def _texts(scope) -> list[str]:
    return sorted(m.memory for m in memory_list(scope, page_size=100, call=internal_call()).memories)


def test_a_move_whose_memory_keeps_changing_gives_up_retryable_and_changes_nothing(alice_scope, monkeypatch):
    """A move re-reads its memory under the text lock of what it holds now; after three
    reads that each found another text, it gives up as a busy resource (the race was
    another writer's), with nothing moved."""
    memory = memory_remember(alice_scope, memory="Alice walks daily", fields={"agent_id": "a"}, call=internal_call())
    changing = count()
    # Every read finds the memory holding another text than the one locked for it.
    monkeypatch.setattr(services, "_move_text_digest", lambda item, fields: f"text-{next(changing)}")
    with pytest.raises(ServiceError) as refused:
        memory_update(alice_scope, memory_id=memory.id, fields={"agent_id": "b"}, call=internal_call())
    assert refused.value.code == ErrorCode.RESOURCE_BUSY
    assert refused.value.retry_after_s == 1
    assert next(changing) == 7  # the read before the loop, then two per attempt
    monkeypatch.undo()
    listed = memory_list(alice_scope, page_size=10, call=internal_call()).memories
    assert [(m.id, m.agent_id) for m in listed] == [(memory.id, "a")]


def test_an_import_a_concurrent_store_rolled_back_is_retryable_and_a_retry_skips_that_text(
    alice_scope, bob_scope, monkeypatch
):
    """A `remember` of one of the file's texts commits while the import runs: the import's
    hash meets the unique constraint and the whole import rolls back, answered
    `resource_busy` (retry); the retry imports the rest and skips the stored text."""
    records = [{"memory": "Alice plays the cello"}, {"memory": "Alice grows tomatoes"}]
    # As mem0's `get_all` writes a file.
    data = json.dumps({"results": [{"id": f"m{n}", "user_id": "dana"} | r for n, r in enumerate(records)]}).encode()
    memory_remember(bob_scope, memory="Alice plays the cello", call=internal_call())  # bob's, no race
    owners = services._hash_owner_rows
    raced = []

    def read_then_store_meanwhile(scope, *, digests):
        found = owners(scope, digests=digests)
        if not raced:
            raced.append(True)
            InThread(
                lambda: memory_remember(alice_scope, memory="Alice plays the cello", call=internal_call())
            ).result()
        return found

    monkeypatch.setattr(services, "_hash_owner_rows", read_then_store_meanwhile)
    with pytest.raises(ServiceError) as refused:
        memory_import_file(alice_scope, data=data, source="mem0", call=internal_call())
    assert refused.value.code == ErrorCode.RESOURCE_BUSY
    assert refused.value.retry_after_s == 1
    assert _texts(alice_scope) == ["Alice plays the cello"]  # the store's; nothing of the import
    memory_import_file(alice_scope, data=data, source="mem0", call=internal_call())
    assert _texts(alice_scope) == ["Alice grows tomatoes", "Alice plays the cello"]
    assert _texts(bob_scope) == ["Alice plays the cello"]
