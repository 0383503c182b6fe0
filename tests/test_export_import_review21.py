"""Review 21 of export and import: a file exported while a memory expires still imports,
store_memory pairs keep their link through a round trip, and `manage.py export_memories`
checks where it writes before it bills."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from core.scope import MemoryScope
from memories.engine import payload
from memories.services import memory_export_stream, memory_import_file, memory_remember
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def _import_jsonl(scope: MemoryScope, records: list[dict]) -> None:
    header = {"format": "memsite.memories", "version": 1, "count": len(records)}
    data = "\n".join(json.dumps(r) for r in [header, *records]) + "\n"
    memory_import_file(scope, data=data.encode(), source="memsite", call=internal_call())


class _ADayLater(datetime):
    """The engine's clock once a slow client has kept the download open for a day."""

    @classmethod
    def now(cls, tz=None):
        return datetime.now(tz) + timedelta(days=1)


def test_a_memory_expiring_during_the_download_is_written_as_counted(alice_scope, bob_scope, monkeypatch):
    memory_remember(alice_scope, memory="Alice likes tea", call=internal_call())
    soon = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    _import_jsonl(alice_scope, [{"text": "Alice is in a meeting right now", "expires_at": soon}])

    lines = memory_export_stream(alice_scope, file_format="jsonl", call=internal_call())
    header = next(lines)  # the snapshot is open and the memories counted
    assert json.loads(header)["count"] == 2
    monkeypatch.setattr(payload, "datetime", _ADayLater)  # the short-lived memory expires
    records = [json.loads(line) for line in lines]

    assert sorted(r["text"] for r in records) == ["Alice is in a meeting right now", "Alice likes tea"]
    monkeypatch.undo()
    result = memory_import_file(
        bob_scope, data=(header + "".join(json.dumps(r) + "\n" for r in records)).encode(), source="memsite",
        call=internal_call(),
    )  # fmt: skip
    assert (result.imported, result.expired) == (2, 0)
