"""Export and import of one user's memories (issue 17, acceptance 3): lossless round trip,
idempotent re-import, mem0 and OpenMemory files, truncated files refused whole, tenancy,
and the REST, web and manage.py surfaces."""

from __future__ import annotations

import gzip
import io
import json
import threading
import zipfile
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from prometheus_client import REGISTRY

from audit.models import AuditEvent, MemoryHistory
from billing.models import UsageEvent
from core.errors import ErrorCode, ServiceError
from core.scope import MemoryScope
from memories import operations, services
from memories.interfaces import downloads
from memories.services import (
    api_key_issue,
    memory_export,
    memory_import_file,
    memory_list,
    memory_remember,
    memory_update,
)
from tests.conftest import age_memory, asgi_get, internal_call, lines_counted

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

FIXTURES = Path(__file__).parent / "fixtures"


def _memories(scope: MemoryScope) -> list[dict]:
    return [v.as_dict() for v in memory_list(scope, page_size=200, call=internal_call()).memories]


def _comparable(memory: dict) -> dict:
    return {k: v for k, v in memory.items() if k != "id"}


def _history_counts(scope: MemoryScope) -> dict[str, int]:
    return {m["memory"]: MemoryHistory.objects.filter(memory_id=m["id"]).count() for m in _memories(scope)}


@pytest.fixture
def alice_memories(alice_scope):
    memory_remember(alice_scope, memory="Alice takes her coffee black", call=internal_call())
    pinned = memory_remember(
        alice_scope,
        memory="Alice is allergic to peanuts",
        pinned=True,
        metadata={"topic": "health"},
        call=internal_call(),
    )
    age_memory(pinned.id, 40)
    edited = memory_remember(
        alice_scope,
        memory="Alice lives in Lyon",
        metadata={"n": 3},
        fields={
            "memory_type": "project",
            "tags": ["home", "france"],
            "importance": 0.9,
            "agent_id": "planner",
            "session_id": "s-1",
            "ttl_days": 30,
            "why_stored": "for travel plans",
        },
        call=internal_call(),
    )
    memory_update(alice_scope, memory_id=edited.id, memory="Alice lives in Grenoble", call=internal_call())
    memory_remember(alice_scope, memory="Alice's notes:\nline two with ünïcode ✓", call=internal_call())
    return alice_scope


def _export(scope: MemoryScope, file_format: str = "jsonl") -> str:
    return memory_export(scope, file_format=file_format, call=internal_call()).content


def _import(scope: MemoryScope, data: bytes | str, source: str = "memsite"):
    raw = data.encode() if isinstance(data, str) else data
    return memory_import_file(scope, data=raw, source=source, call=internal_call())


def _refused(scope: MemoryScope, data: bytes | str, source: str = "memsite") -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        _import(scope, data, source)
    return caught.value


# --- round trip ------------------------------------------------------------------------------
def test_export_then_import_into_a_fresh_user_gives_identical_memories(alice_memories, bob_scope):
    exported = _export(alice_memories)
    header, *lines = exported.splitlines()
    assert json.loads(header)["count"] == 4 == len(lines)
    record = json.loads(lines[0])
    assert set(record) == {
        "id", "text", "pinned", "metadata", "source", "client_app", "created_at", "updated_at", "history",
        "memory_type", "tags", "importance", "agent_id", "session_id", "expires_at", "why_stored",
        "last_recalled_at", "access_count",
    }  # fmt: skip

    result = _import(bob_scope, exported)
    assert (result.imported, result.duplicates) == (4, 0)
    original = sorted((_comparable(m) for m in _memories(alice_memories)), key=lambda m: m["memory"])
    copied = sorted((_comparable(m) for m in _memories(bob_scope)), key=lambda m: m["memory"])
    assert copied == original  # text, pinned, metadata, source, client_app, times, every field, recalls
    lyon = next(m for m in copied if m["memory"] == "Alice lives in Grenoble")
    assert (lyon["memory_type"], lyon["tags"], lyon["agent_id"], lyon["why_stored"]) == (
        "project", ["home", "france"], "planner", "for travel plans"
    )  # fmt: skip
    assert lyon["expires_at"] and lyon["importance"] == 0.9
    assert _history_counts(bob_scope) == _history_counts(alice_memories)
    assert _history_counts(bob_scope)["Alice lives in Grenoble"] == 2
    # ...and the copy exports to the same file, apart from ids and the export time.
    again = [json.loads(line) for line in _export(bob_scope).splitlines()[1:]]
    first = [json.loads(line) for line in lines]
    assert [{**r, "id": None} for r in again] == [{**r, "id": None} for r in first]


def test_imported_memories_are_searchable_and_old_ones_keep_their_age(alice_memories, bob_scope):
    from memories.services import memory_search

    _import(bob_scope, _export(alice_memories))
    found = memory_search(bob_scope, query="peanut allergy", top_k=1, call=internal_call())
    assert found[0].memory == "Alice is allergic to peanuts" and found[0].pinned
    assert found[0].created_at < _memories(bob_scope)[-1]["created_at"]


def test_importing_twice_adds_nothing(alice_memories, bob_scope):
    exported = _export(alice_memories)
    _import(bob_scope, exported)
    before = _memories(bob_scope)
    again = _import(bob_scope, exported)
    assert (again.imported, again.duplicates) == (0, 4)
    assert _memories(bob_scope) == before
    # Into the exporting user itself: everything is already there.
    assert _import(alice_memories, exported).imported == 0


def test_export_and_import_are_audited_and_billed_once_each(alice_memories, bob_scope):
    exported = _export(alice_memories)
    _import(bob_scope, exported)
    for operation in ("export_memories", "import_memories"):
        assert UsageEvent.objects.filter(operation=operation).count() == 1
        row = AuditEvent.objects.get(operation=operation)
        assert row.outcome == "ok"
    assert AuditEvent.objects.get(operation="import_memories").detail["imported"] == 4
    assert len(AuditEvent.objects.get(operation="import_memories").memory_ids) == 4


def test_markdown_export_is_readable(alice_memories):
    text = _export(alice_memories, "markdown")
    assert text.startswith("# Memories of")
    assert "## Pinned\n\n- Alice is allergic to peanuts" in text
    assert "- Alice lives in Grenoble" in text and "2 versions" in text
    assert "  line two with ünïcode ✓" in text  # multi-line text stays inside its item


# --- refusals: nothing partial ------------------------------------------------------------------
def test_a_truncated_file_is_refused_whole(alice_memories, bob_scope):
    exported = _export(alice_memories)
    cut_mid_line = exported[: len(exported) - 40]
    cut_at_line = "\n".join(exported.splitlines()[:3]) + "\n"
    for broken in (cut_mid_line, cut_at_line):
        error = _refused(bob_scope, broken)
        assert error.code == ErrorCode.INVALID_ARGUMENT and "truncated" in error.message
        assert _memories(bob_scope) == []


@pytest.mark.parametrize(
    ("mutate", "code"),
    [
        (lambda lines: ["not json"] + lines[1:], ErrorCode.INVALID_ARGUMENT),
        (lambda lines: [lines[0].replace('"version": 1', '"version": 9')] + lines[1:], ErrorCode.INVALID_ARGUMENT),
        (lambda lines: lines[:2] + [lines[2].replace('"text": "', '"text": "' + "x" * 9000)] + lines[3:],
         ErrorCode.PAYLOAD_TOO_LARGE),
        (lambda lines: lines[:2] + [json.dumps({**json.loads(lines[2]), "metadata": {"user_id": "default:1"}})]
         + lines[3:], ErrorCode.INVALID_ARGUMENT),
        (lambda lines: lines[:2] + [json.dumps({**json.loads(lines[2]), "created_at": "yesterday"})] + lines[3:],
         ErrorCode.INVALID_ARGUMENT),
    ],
)  # fmt: skip
def test_a_bad_record_anywhere_refuses_the_whole_file(alice_memories, bob_scope, mutate, code):
    lines = _export(alice_memories).splitlines()
    error = _refused(bob_scope, "\n".join(mutate(lines)) + "\n")
    assert error.code == code
    assert "Alice" not in error.message  # content never echoed in errors
    assert _memories(bob_scope) == []


def test_file_size_and_count_limits(bob_scope, settings):
    settings.IMPORT_MAX_BYTES = 100
    assert _refused(bob_scope, b"x" * 101).code == ErrorCode.PAYLOAD_TOO_LARGE
    settings.IMPORT_MAX_BYTES = 1_000_000
    settings.IMPORT_MAX_MEMORIES = 1
    assert _refused(bob_scope, (FIXTURES / "mem0_export.json").read_bytes(), "mem0").code == ErrorCode.PAYLOAD_TOO_LARGE
    assert _memories(bob_scope) == []


# --- other products' files ----------------------------------------------------------------------
def test_mem0_export_imports(bob_scope):
    result = _import(bob_scope, (FIXTURES / "mem0_export.json").read_bytes(), "mem0")
    assert (result.imported, result.duplicates) == (3, 0)
    by_text = {m["memory"]: m for m in _memories(bob_scope)}
    assert set(by_text) == {"Prefers vegetarian food", "Works as a nurse in Leeds", "Has a cat called Miso"}
    nurse = by_text["Works as a nurse in Leeds"]
    # mem0 wrote US/Pacific times; they are kept, in UTC.
    assert nurse["created_at"] == "2025-03-02T17:30:00.000000+00:00"
    assert nurse["updated_at"] == "2025-04-01T08:00:00.000000+00:00"
    assert nurse["metadata"] == {"category": "work"} and nurse["source"] == "mem0"
    assert _import(bob_scope, (FIXTURES / "mem0_export.json").read_bytes(), "mem0").imported == 0


def test_truncated_mem0_file_is_refused(bob_scope):
    raw = (FIXTURES / "mem0_export.json").read_bytes()
    assert _refused(bob_scope, raw[: len(raw) // 2], "mem0").code == ErrorCode.INVALID_ARGUMENT
    assert _memories(bob_scope) == []


def openmemory_zip() -> bytes:
    """An export as OpenMemory's `POST /api/v1/backup/export` writes it: memories.json
    (user, apps, categories, memories, memory_categories, status_history, access_controls,
    export_meta) and memories.jsonl.gz (one logical record per line)."""
    user = {
        "id": "5d0c7a52-0000-4000-8000-000000000001",
        "user_id": "carol",
        "name": None,
        "email": None,
        "metadata": {},
        "created_at": "2025-01-05T09:00:00+00:00",
        "updated_at": "2025-01-05T09:00:00+00:00",
    }
    apps = [
        {
            "id": "a0000000-0000-4000-8000-000000000001",
            "owner_id": user["id"],
            "name": "claude",
            "description": None,
            "metadata": {},
            "is_active": True,
            "created_at": "2025-01-05T09:00:00+00:00",
            "updated_at": "2025-01-05T09:00:00+00:00",
        }
    ]
    memories = [
        {"id": "m0000000-0000-4000-8000-00000000000a".replace("m", "b"), "user_id": user["id"], "app_id": apps[0]["id"],
         "content": "Carol runs marathons", "metadata": {"mood": "proud"}, "state": "active",
         "created_at": "2025-02-01T10:00:00+00:00", "updated_at": "2025-02-01T10:00:00+00:00",
         "archived_at": None, "deleted_at": None, "category_ids": ["c0000000-0000-4000-8000-000000000001"]},
        {"id": "b0000000-0000-4000-8000-00000000000b", "user_id": user["id"], "app_id": None,
         "content": "Carol is learning Japanese", "metadata": {}, "state": "archived",
         "created_at": "2025-02-03T10:00:00+00:00", "updated_at": "2025-02-04T10:00:00+00:00",
         "archived_at": "2025-02-04T10:00:00+00:00", "deleted_at": None, "category_ids": []},
        {"id": "b0000000-0000-4000-8000-00000000000c", "user_id": user["id"], "app_id": apps[0]["id"],
         "content": "Carol used to smoke", "metadata": {}, "state": "deleted",
         "created_at": "2025-01-10T10:00:00+00:00", "updated_at": "2025-01-11T10:00:00+00:00",
         "archived_at": None, "deleted_at": "2025-01-11T10:00:00+00:00", "category_ids": []},
    ]  # fmt: skip
    document = {
        "user": user,
        "apps": apps,
        "categories": [{"id": "c0000000-0000-4000-8000-000000000001", "name": "health", "description": None,
                        "created_at": None, "updated_at": None}],
        "memories": memories,
        "memory_categories": [{"memory_id": memories[0]["id"], "category_id": "c0000000-0000-4000-8000-000000000001"}],
        "status_history": [],
        "access_controls": [],
        "export_meta": {"app_id_filter": None, "from_date": None, "to_date": None, "version": "1",
                        "generated_at": "2026-01-01T00:00:00+00:00"},
    }  # fmt: skip
    logical = "".join(
        json.dumps({"id": m["id"], "content": m["content"], "metadata": m["metadata"], "created_at": m["created_at"],
                    "updated_at": m["updated_at"], "state": m["state"], "app": "claude", "categories": []}) + "\n"
        for m in memories
    )  # fmt: skip
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("memories.json", json.dumps(document, indent=2))
        archive.writestr("memories.jsonl.gz", gzip.compress(logical.encode()))
    return buffer.getvalue()


def test_openmemory_zip_imports(bob_scope):
    result = _import(bob_scope, openmemory_zip(), "openmemory")
    assert (result.imported, result.duplicates) == (2, 0)  # the deleted memory stays gone
    by_text = {m["memory"]: m for m in _memories(bob_scope)}
    assert set(by_text) == {"Carol runs marathons", "Carol is learning Japanese"}
    marathons = by_text["Carol runs marathons"]
    assert marathons["client_app"] == "claude" and marathons["source"] == "openmemory"
    assert marathons["metadata"] == {"mood": "proud"}
    assert marathons["created_at"] == "2025-02-01T10:00:00.000000+00:00"
    assert marathons["tags"] == ["health"]  # OpenMemory's categories become tags
    assert by_text["Carol is learning Japanese"]["updated_at"] == "2025-02-04T10:00:00.000000+00:00"
    assert _import(bob_scope, openmemory_zip(), "openmemory").imported == 0


def test_truncated_or_foreign_zip_is_refused(bob_scope):
    raw = openmemory_zip()
    assert _refused(bob_scope, raw[: len(raw) - 30], "openmemory").code == ErrorCode.INVALID_ARGUMENT
    empty = io.BytesIO()
    with zipfile.ZipFile(empty, "w") as archive:
        archive.writestr("other.txt", "hi")
    assert "memories.json" in _refused(bob_scope, empty.getvalue(), "openmemory").message
    assert _memories(bob_scope) == []


# --- tenancy and surfaces ----------------------------------------------------------------------
def _body(response) -> bytes:
    return b"".join(response.streaming_content)


def test_rest_export_and_import_are_scoped_by_the_token(alice, bob, alice_memories, api_client):
    _, alice_key = api_key_issue(user=alice)
    _, bob_key = api_key_issue(user=bob)
    bob_export = api_client(bob_key).get("/v1/memories/export?format=jsonl")
    assert bob_export.status_code == 200
    assert json.loads(_body(bob_export).decode().splitlines()[0])["count"] == 0
    assert b"Alice" not in _body(bob_export)
    # Naming another user is refused (bob may act for no one), audited, and reads nothing.
    other = api_client(bob_key).get("/v1/memories/export", HTTP_X_MEMORY_SUBJECT="default/alice")
    assert other.status_code == 403 and other.json()["error"]["code"] == "forbidden"
    assert b"Alice" not in other.content

    exported = api_client(alice_key).get("/v1/memories/export")
    assert exported.status_code == 200 and exported["Content-Type"].startswith("application/x-ndjson")
    assert exported["Content-Disposition"] == 'attachment; filename="memories.jsonl"'
    exported_file = _body(exported)
    markdown = api_client(alice_key).get("/v1/memories/export?format=markdown")
    assert markdown.status_code == 200 and b"# Memories of alice" in _body(markdown)
    assert markdown["Content-Type"].startswith("text/markdown")
    bad = api_client(alice_key).get("/v1/memories/export?format=pdf")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_argument"
    assert api_client(alice_key).get("/v1/memories/export?user_id=1").status_code == 400

    upload = io.BytesIO(exported_file)
    upload.name = "memories.jsonl"
    imported = api_client(bob_key).post("/v1/memories/import", {"file": upload}, format="multipart")
    assert imported.status_code == 200, imported.content
    assert imported.json()["imported"] == 4
    assert len(_memories(MemoryScope.for_user(bob))) == 4
    assert len(_memories(alice_memories)) == 4  # nothing written into alice

    raw = api_client(bob_key).post(
        "/v1/memories/import?from=mem0",
        (FIXTURES / "mem0_export.json").read_bytes(),
        content_type="application/json",
    )
    assert raw.status_code == 200 and raw.json()["imported"] == 3
    truncated = api_client(bob_key).post(
        "/v1/memories/import", exported_file[:-50], content_type="application/x-ndjson"
    )
    assert truncated.status_code == 400 and truncated.json()["error"]["code"] == "invalid_argument"
    assert api_client().get("/v1/memories/export").status_code == 401
    failed = AuditEvent.objects.filter(operation="import_memories", outcome="error")
    assert failed.count() == 1 and failed.get().error_code == "invalid_argument"


def test_web_download_and_upload(client, alice, bob, alice_memories):
    client.force_login(alice)
    assert b"Import memories" in client.get("/data/").content
    download = client.post("/data/export/", {"format": "jsonl"})
    assert download.status_code == 200 and "attachment" in download["Content-Disposition"]
    client.force_login(bob)
    upload = io.BytesIO(b"".join(download.streaming_content))
    upload.name = "memories.jsonl"
    page = client.post("/data/import/", {"source": "memsite", "file": upload}, follow=True)
    assert b"Imported 4 memories; 0 you already had were skipped." in page.content
    zipped = io.BytesIO(openmemory_zip()[:-30])
    zipped.name = "export.zip"
    page = client.post("/data/import/", {"source": "openmemory", "file": zipped}, follow=True)
    assert b"Nothing was imported" in page.content
    assert len(_memories(MemoryScope.for_user(bob))) == 4


def test_manage_py_export_and_import(alice_memories, bob, tmp_path, capsys):
    target = tmp_path / "alice.jsonl"
    call_command("export_memories", "alice", "-o", str(target))
    assert json.loads(target.read_text().splitlines()[0])["count"] == 4
    call_command("import_memories", "bob", str(target))
    assert "imported 4 memories" in capsys.readouterr().out
    assert len(_memories(MemoryScope.for_user(bob))) == 4
    call_command("import_memories", "bob", str(FIXTURES / "mem0_export.json"), "--from", "mem0")
    assert len(_memories(MemoryScope.for_user(bob))) == 7
    (tmp_path / "cut.jsonl").write_text(target.read_text()[:-30])
    with pytest.raises(CommandError, match="invalid_argument"):
        call_command("import_memories", "bob", str(tmp_path / "cut.jsonl"))
    with pytest.raises(CommandError, match="no user"):
        call_command("export_memories", "nobody")
    call_command("export_memories", "alice", "--format", "markdown")
    assert "Alice lives in Grenoble" in capsys.readouterr().out


def test_manage_py_export_is_written_as_read_and_whole_or_not_at_all(alice_memories, tmp_path, capsys, monkeypatch):
    """The operator's export streams like the web download (same file: one header, one line
    per memory, billed once); cut short by the engine, it leaves no partial file and keeps
    the file an earlier run wrote."""
    from memories import services

    target = tmp_path / "alice.jsonl"
    call_command("export_memories", "alice", "-o", str(target))
    first = target.read_text()
    header, *lines = first.splitlines()
    assert json.loads(header)["count"] == len(lines) == 4
    assert sorted(json.loads(line)["text"] for line in lines) == sorted(m["memory"] for m in _memories(alice_memories))
    assert "export: 4/4 memories written" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [target]
    billed = UsageEvent.objects.filter(operation="export_memories").count()
    assert billed == 1

    def engine_down(*args, **kwargs):
        from memories.engine import EngineError

        raise EngineError("engine down")

    monkeypatch.setattr(services, "engine_memories_page", engine_down)
    with pytest.raises(CommandError, match="backend_unavailable"):
        call_command("export_memories", "alice", "-o", str(target))
    assert target.read_text() == first
    assert list(tmp_path.iterdir()) == [target]


def test_history_selector_never_returns_another_users_versions(alice_memories, bob_scope):
    from memories.selectors import memory_histories

    alice_ids = [m["id"] for m in _memories(alice_memories)]
    assert memory_histories(bob_scope, memory_ids=alice_ids) == {}
    assert set(memory_histories(alice_memories, memory_ids=alice_ids)) == set(alice_ids)


def _record(text: str, **fields) -> dict:
    return {"text": text, "pinned": False, "metadata": {}, "created_at": "2025-05-01T00:00:00Z", **fields}


def _jsonl(records: list[dict]) -> str:
    header = {"format": "memsite.memories", "version": 1, "count": len(records)}
    return "\n".join(json.dumps(r) for r in [header, *records]) + "\n"


def test_trash_is_not_exported_and_expired_memories_are_not_imported(alice_memories, bob_scope):
    from memories.services import memory_delete

    gone = next(m for m in _memories(alice_memories) if m["memory"] == "Alice takes her coffee black")
    memory_delete(alice_memories, memory_id=gone["id"], call=internal_call())
    exported = _export(alice_memories)
    assert json.loads(exported.splitlines()[0])["count"] == 3 and "coffee" not in exported

    data = _jsonl(
        [
            _record("Bob's old promo code", expires_at="2020-01-01T00:00:00Z"),
            _record("Bob likes chess", access_count=3, last_recalled_at="2025-06-01T12:00:00Z", tags=["games"]),
            _record("bob likes  CHESS"),  # the same text by the dedupe rule: skipped
        ]
    )
    result = _import(bob_scope, data)
    assert (result.imported, result.duplicates, result.expired) == (1, 1, 1)
    (chess,) = _memories(bob_scope)
    assert (chess["access_count"], chess["last_recalled_at"], chess["tags"]) == (
        3, "2025-06-01T12:00:00.000000+00:00", ["games"]
    )  # fmt: skip


def test_an_engine_failure_midway_leaves_nothing_imported(alice_memories, bob_scope, monkeypatch):
    import memories.services as services
    from memories.engine import EngineError
    from memories.models import ContentHash

    real = services.engine_insert_imported
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise EngineError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(services, "engine_insert_imported", failing)
    assert _refused(bob_scope, _export(alice_memories)).code == ErrorCode.BACKEND_UNAVAILABLE
    assert _memories(bob_scope) == []
    assert not ContentHash.objects.filter(engine_user_id=bob_scope.engine_user_id).exists()
    assert not UsageEvent.objects.filter(operation="import_memories").exists()
    monkeypatch.setattr(services, "engine_insert_imported", real)
    assert _import(bob_scope, _export(alice_memories)).imported == 4  # the retry completes it


def test_a_field_out_of_range_refuses_the_file(bob_scope):
    for bad in ({"importance": 7}, {"memory_type": "gossip"}, {"access_count": -1}, {"expires_at": "soon"}):
        error = _refused(bob_scope, _jsonl([_record("Bob likes chess"), _record("Bob is tall", **bad)]))
        assert error.code == ErrorCode.INVALID_ARGUMENT and "line 3" in error.message
    assert _memories(bob_scope) == []


def test_rest_takes_a_raw_body_above_djangos_upload_limit(bob, api_client, settings):
    """`request.body` stops at DATA_UPLOAD_MAX_MEMORY_SIZE; the import limit is its own."""
    _, bob_key = api_key_issue(user=bob)
    records = [_record(f"Bob fact number {n} " + "padding " * 60) for n in range(12)]
    data = _jsonl(records).encode()
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = len(data) // 2
    response = api_client(bob_key).post("/v1/memories/import", data, content_type="application/x-ndjson")
    assert response.status_code == 200, response.content
    assert response.json()["imported"] == 12
    settings.IMPORT_MAX_BYTES = len(data) - 1
    too_big = api_client(bob_key).post("/v1/memories/import", data, content_type="application/x-ndjson")
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "payload_too_large"


def test_rest_export_is_sent_while_it_is_read_and_is_one_billed_audited_call(alice, bob, alice_memories, monkeypatch):
    """Under ASGI (the web process), REST's export goes out in batches while it is read,
    never built whole; it is one call: one audit row, one usage event, counted once in the
    metrics until its last line. bob's key reads only bob's file."""
    monkeypatch.setattr(services, "EXPORT_PAGE_SIZE", 2)
    monkeypatch.setattr(downloads, "DOWNLOAD_BATCH_LINES", 2)
    produced = lines_counted(monkeypatch, operations, "memory_export_stream")
    threads = _threads_recorded(monkeypatch)
    _, alice_key = api_key_issue(user=alice)
    _, bob_key = api_key_issue(user=bob)
    billed = UsageEvent.objects.count()
    served = _rest_exports_counted()
    status, body, sent_at = asgi_get(
        "/v1/memories/export?format=jsonl", authorization=f"Bearer {alice_key}", produced=produced
    )
    assert status == 200 and len(body.decode().splitlines()) == 5 == len(produced)
    assert sent_at[0] <= 2 < len(produced) and len(sent_at) >= 3
    # Read on the thread (and so the database connection) the view audited and billed on.
    assert len(threads) == 6 and set(threads) == {threads[0]}
    rows = AuditEvent.objects.filter(operation="export_memories")
    assert [(r.outcome, r.channel, r.actor_user_id) for r in rows] == [("ok", "rest", alice.pk)]
    assert UsageEvent.objects.count() == billed + 1
    assert _rest_exports_counted() == served + 1

    produced.clear()
    status, body, _ = asgi_get(
        "/v1/memories/export?format=markdown", authorization=f"Bearer {bob_key}", produced=produced
    )
    assert status == 200 and b"0 memories" in body and b"Alice" not in body
    status, body, _ = asgi_get("/v1/memories/export?format=pdf", authorization=f"Bearer {bob_key}", produced=produced)
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_argument"
    assert UsageEvent.objects.count() == billed + 2
    refused = AuditEvent.objects.filter(operation="export_memories", outcome="error").get()
    assert refused.error_code == "invalid_argument" and refused.actor_user_id == bob.pk


def _rest_exports_counted() -> float:
    labels = {"operation": "export_memories", "channel": "rest", "outcome": "ok", "code": ""}
    return REGISTRY.get_sample_value("memsite_calls_total", labels) or 0.0


def _threads_recorded(monkeypatch) -> list[int]:
    """The thread memory_export_stream is called on, then the thread each line is read on."""
    threads: list[int] = []
    stream = operations.memory_export_stream

    def recorded(*args, **kwargs):
        threads.append(threading.get_ident())
        lines = stream(*args, **kwargs)

        def each():
            for line in lines:
                threads.append(threading.get_ident())
                yield line

        return each()

    monkeypatch.setattr(operations, "memory_export_stream", recorded)
    return threads


def test_an_openmemory_memorys_reserved_metadata_keys_come_in_renamed(bob_scope):
    """OpenMemory, built on mem0, reserves none of memsite's keys: a `source` or `pinned`
    in its metadata is the owner's (or its MCP server's) label, and it refused the whole
    file. They come in as `openmemory_<key>` and change nothing memsite keeps."""
    with zipfile.ZipFile(io.BytesIO(openmemory_zip())) as archive:
        document = json.loads(archive.read("memories.json"))
    document["memories"][0]["metadata"] = {"source": "slack", "pinned": True, "mcp_client": "claude"}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("memories.json", json.dumps(document))
    assert _import(bob_scope, buffer.getvalue(), "openmemory").imported == 2
    marathons = {m["memory"]: m for m in _memories(bob_scope)}["Carol runs marathons"]
    assert marathons["metadata"] == {"openmemory_source": "slack", "openmemory_pinned": True, "mcp_client": "claude"}
    assert (marathons["source"], marathons["pinned"]) == ("openmemory", False)
