"""Review 21 of export and import: a file exported while a memory expires still imports,
store_memory pairs keep their link through a round trip, and `manage.py export_memories`
checks where it writes before it bills."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.scope import CallContext, MemoryScope
from memories.auth import Principal
from memories.engine import payload
from memories.operations import operation_execute
from memories.services import (
    memory_export,
    memory_export_stream,
    memory_import_file,
    memory_list,
    memory_remember,
)
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


# --- store_memory pairs ------------------------------------------------------------------
PRIVATE = "My home address is 12 Rue des Lilas, please keep it private."


def run(user, name: str, **arguments) -> dict:
    principal = Principal(user=user, method="api_key", client_app="agent")
    return operation_execute(principal, name, arguments, call=CallContext(channel="mcp"))


def _export_lines(user) -> list[dict]:
    content = memory_export(MemoryScope.for_user(user), file_format="jsonl", call=internal_call()).content
    return [json.loads(line) for line in content.splitlines()]


def _import_lines(user, lines: list[dict]) -> None:
    header, *records = lines
    data = "\n".join(json.dumps(r) for r in [{**header, "count": len(records)}, *records]) + "\n"
    memory_import_file(MemoryScope.for_user(user), data=data.encode(), source="memsite", call=internal_call())


def _by_tier(user) -> dict[str, dict]:
    memories = memory_list(MemoryScope.for_user(user), page_size=50, call=internal_call()).memories
    return {str(m.metadata.get("tier")): m.as_dict() for m in memories}


def test_a_store_memory_pair_is_still_one_message_after_export_and_import(alice, bob):
    run(alice, "store_memory", conversation_id="c1", messages=[{"role": "human", "content": PRIVATE}])
    _import_lines(bob, _export_lines(alice))

    rows = _by_tier(bob)
    assert rows["ltm"]["metadata"]["stm_id"] == rows["stm"]["id"]
    assert run(bob, "toolkit_delete_memory", memory_id=rows["stm"]["id"])["deleted_count"] == 2
    assert _by_tier(bob) == {}


def test_a_candidate_whose_short_term_row_is_not_imported_loses_the_dead_link(alice, bob):
    """The short-term row expired before the export (or is cut from the file): the old id
    names a row of alice's, never one of bob's."""
    run(alice, "store_memory", conversation_id="c1", messages=[{"role": "human", "content": PRIVATE}])
    header, *records = _export_lines(alice)
    _import_lines(bob, [header, *[r for r in records if r["metadata"]["tier"] == "ltm"]])

    (only,) = _by_tier(bob).values()
    assert "stm_id" not in only["metadata"] and only["metadata"]["tier"] == "ltm"
    assert run(bob, "toolkit_delete_memory", memory_id=only["id"])["deleted_count"] == 1


def test_an_stm_id_another_surface_set_is_the_users_metadata_and_kept(alice, bob):
    stm_id = run(alice, "store_memory", conversation_id="c1", messages=[{"role": "assistant", "content": "Noted."}])[
        "stm_ids"
    ][0]
    memory_remember(
        MemoryScope.for_user(alice), memory="A note", metadata={"tier": "ltm", "stm_id": stm_id}, call=internal_call()
    )
    _import_lines(bob, _export_lines(alice))

    assert _by_tier(bob)["ltm"]["metadata"]["stm_id"] == stm_id


# --- manage.py export_memories -o ----------------------------------------------------------
def _export_calls() -> tuple[int, int]:
    return (
        UsageEvent.objects.filter(operation="export_memories").count(),
        AuditEvent.objects.filter(operation="export_memories").count(),
    )


def test_export_to_a_missing_directory_is_refused_before_anything_is_read_or_billed(alice, tmp_path):
    memory_remember(MemoryScope.for_user(alice), memory="Alice likes tea", call=internal_call())
    target = tmp_path / "missing" / "alice.jsonl"

    with pytest.raises(CommandError, match=f"cannot write the export to {target}: No such file or directory"):
        call_command("export_memories", "alice", "-o", str(target))

    assert _export_calls() == (0, 0)
    assert list(tmp_path.iterdir()) == []


def test_the_export_file_is_readable_by_its_owner_only(alice, tmp_path):
    memory_remember(MemoryScope.for_user(alice), memory="Alice likes tea", call=internal_call())
    target = tmp_path / "alice.jsonl"
    target.write_text("an older export")
    target.chmod(0o644)
    (tmp_path / "alice.jsonl.partial").write_text("left by a killed run")  # not reused: made anew

    call_command("export_memories", "alice", "-o", str(target))

    assert target.stat().st_mode & 0o777 == 0o600
    assert json.loads(target.read_text().splitlines()[0])["count"] == 1
    assert list(tmp_path.iterdir()) == [target]


def test_a_write_error_midway_is_a_clear_error_and_keeps_the_earlier_file(alice, tmp_path, monkeypatch):
    from memories.management.commands import export_memories

    scope = MemoryScope.for_user(alice)
    for n in range(3):
        memory_remember(scope, memory=f"Alice fact number {n}", call=internal_call())
    target = tmp_path / "alice.jsonl"
    target.write_text("an older export")
    real_open = export_memories._partial_open

    class DiskFull:
        def __init__(self, out):
            self.out, self.lines = out, 0

        def write(self, text):
            self.lines += 1
            if self.lines == 3:
                raise OSError(28, "No space left on device")
            return self.out.write(text)

        def __getattr__(self, name):
            return getattr(self.out, name)

    monkeypatch.setattr(export_memories, "_partial_open", lambda path: DiskFull(real_open(path)))

    with pytest.raises(CommandError, match=f"writing the export to {target} failed: No space left on device"):
        call_command("export_memories", "alice", "-o", str(target))

    assert target.read_text() == "an older export"
    assert list(tmp_path.iterdir()) == [target]
    assert _export_calls() == (1, 1)  # read and billed, as the operator is told


class _ClosedPipe:
    """stdout whose reader went away after the first line (`export_memories alice | head -1`)."""

    def __init__(self) -> None:
        self.lines = 0

    def write(self, text: str) -> None:
        self.lines += 1
        if self.lines > 1:
            raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        pass


def test_a_reader_that_stops_early_is_one_line_not_a_traceback(alice, alice_scope):
    for n in range(3):
        memory_remember(alice_scope, memory=f"Fact number {n} for the pipe", call=internal_call())
    with pytest.raises(CommandError, match="stdout was closed before the export ended"):
        call_command("export_memories", "alice", stdout=_ClosedPipe())
