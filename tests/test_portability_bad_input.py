"""Import files that once answered a raw 500 (deep nesting, NUL and lone surrogates in
fields, timestamps out of range, lists where a scalar belongs) are a coded 400 on every
surface, with nothing imported; failed export and import calls leave exactly one audit
row; and a round trip keeps a toolkit long-term memory beside its short-term copy, and a
null client app null."""

from __future__ import annotations

import io
import json
import zipfile

import pytest

from audit.crypto import content_open
from audit.models import AuditEvent
from core.errors import ErrorCode, ServiceError
from core.scope import MemoryScope
from memories import portability
from memories.auth import Principal
from memories.models import ContentHash
from memories.operations import operation_execute
from memories.services import (
    api_key_issue,
    memory_clear_all,
    memory_export,
    memory_import_file,
    memory_list,
    memory_purge,
    memory_remember,
)
from memories.toolkit.services import toolkit_candidates_enrich
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

NESTED = "[" * 100_000 + "]" * 100_000
HEADER = json.dumps({"format": "memsite.memories", "version": 1, "count": 1})
SECRET = "imported fact"  # never to be quoted by an error message


def _memsite(record: dict | str) -> bytes:
    line = record if isinstance(record, str) else json.dumps(record)
    return f"{HEADER}\n{line}\n".encode()


def _openmemory(document: dict | str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("memories.json", document if isinstance(document, str) else json.dumps(document))
    return buffer.getvalue()


def _zip_flagged(*, encrypted: bool = False, method: int | None = None) -> bytes:
    """A valid OpenMemory zip with its headers edited: marked encrypted, or naming a
    compression method zipfile cannot read."""
    raw = bytearray(_openmemory({"memories": [{"content": "x fact"}]}))
    central = raw.rfind(b"PK\x01\x02")
    if encrypted:
        raw[6] |= 1  # general purpose flag bit 0, local header and central directory
        raw[central + 8] |= 1
    if method is not None:
        raw[8] = raw[central + 10] = method
    return bytes(raw)


def _fact(**fields) -> dict:
    return {"text": SECRET, **fields}


def _om_memory(**fields) -> dict:
    return {"content": "x fact", "state": "active", **fields}


# (case id, source, file bytes, a word the refusal must name or None)
BAD_FILES = [
    ("memsite-nested", "memsite", NESTED.encode(), None),
    ("memsite-header-then-nested", "memsite", _memsite(NESTED), "line 2"),
    ("mem0-nested", "mem0", NESTED.encode(), None),
    ("openmemory-nested", "openmemory", _openmemory(NESTED), None),
    ("history-new-memory-nul", "memsite", _memsite(_fact(history=[{"event": "ADD", "new_memory": "a\0b"}])), "NUL"),
    (
        "history-new-memory-surrogate",
        "memsite",
        _memsite(_fact(history=[{"event": "ADD", "new_memory": "a\ud800b"}])),
        "surrogate",
    ),
    (
        "history-changed-by-nul",
        "memsite",
        _memsite(_fact(history=[{"event": "ADD", "new_memory": SECRET, "changed_by": "x\0"}])),
        "NUL",
    ),
    ("source-nul", "memsite", _memsite(_fact(source="s\0")), "NUL"),
    ("client-app-surrogate", "memsite", _memsite(_fact(client_app="s\ud800")), "surrogate"),
    ("created-at-past-year-9999", "memsite", _memsite(_fact(created_at="9999-12-31T23:59:59-05:00")), "created_at"),
    ("created-at-before-year-1", "memsite", _memsite(_fact(created_at="0001-01-01T00:00:00+05:00")), "created_at"),
    ("expires-at-past-year-9999", "memsite", _memsite(_fact(expires_at="9999-12-31T23:59:59-05:00")), "expires_at"),
    (
        "history-time-past-year-9999",
        "memsite",
        _memsite(_fact(history=[{"event": "ADD", "created_at": "9999-12-31T23:59:59-05:00"}])),
        "created_at",
    ),
    (
        "mem0-time-past-year-9999",
        "mem0",
        json.dumps([{"memory": "x fact", "updated_at": "9999-12-31T23:59:59-05:00"}]).encode(),
        "updated_at",
    ),
    ("history-event-list", "memsite", _memsite(_fact(history=[{"event": ["ADD"]}])), "event"),
    ("openmemory-state-list", "openmemory", _openmemory({"memories": [_om_memory(state=["deleted"])]}), "state"),
    (
        "openmemory-app-id-list",
        "openmemory",
        _openmemory({"memories": [_om_memory()], "apps": [{"id": [1], "name": "a"}]}),
        "apps[0] id",
    ),
    ("openmemory-memory-app-id-list", "openmemory", _openmemory({"memories": [_om_memory(app_id=[1])]}), "app_id"),
    (
        "openmemory-memory-id-object",
        "openmemory",
        _openmemory(
            {
                "memories": [_om_memory(id={"a": 1})],
                "categories": [{"id": "c1", "name": "health"}],
                "memory_categories": [{"memory_id": "m1", "category_id": "c1"}],
            }
        ),
        "memories[0] id",
    ),
    (
        "openmemory-category-id-list",
        "openmemory",
        _openmemory({"memories": [_om_memory()], "memory_categories": [{"category_id": [1]}]}),
        "category_id",
    ),
    ("openmemory-apps-not-a-list", "openmemory", _openmemory({"memories": [_om_memory()], "apps": 5}), "apps"),
    ("openmemory-zip-encrypted", "openmemory", _zip_flagged(encrypted=True), "encrypted"),
    ("openmemory-zip-unknown-method", "openmemory", _zip_flagged(method=99), "compression"),
]
BAD_IDS = [case[0] for case in BAD_FILES]


def _memories(scope: MemoryScope) -> list[dict]:
    return [v.as_dict() for v in memory_list(scope, page_size=200, call=internal_call()).memories]


def _nothing_imported(scope: MemoryScope) -> None:
    assert _memories(scope) == []
    assert not ContentHash.objects.filter(engine_user_id=scope.engine_user_id).exists()


def _import_failures() -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(operation="import_memories").order_by("id"))


# --- the service: one coded refusal, nothing written ------------------------------------------
@pytest.mark.parametrize(("case", "source", "data", "named"), BAD_FILES, ids=BAD_IDS)
def test_a_bad_file_is_refused_with_a_code_and_nothing_imported(bob_scope, case, source, data, named):
    with pytest.raises(ServiceError) as caught:
        memory_import_file(bob_scope, data=data, source=source, call=internal_call())
    error = caught.value
    assert error.code == ErrorCode.INVALID_ARGUMENT, (case, error.message)
    assert SECRET not in error.message and "x fact" not in error.message  # content never echoed
    assert "\0" not in error.message and "\ud800" not in error.message
    if named:
        assert named in error.message, error.message
    _nothing_imported(bob_scope)


def test_ids_that_are_integers_are_still_taken(bob_scope):
    """The type checks refuse lists and objects only: OpenMemory ids may be numbers."""
    document = {
        "memories": [_om_memory(id=7, app_id=1)],
        "apps": [{"id": 1, "name": "claude"}],
        "categories": [{"id": 3, "name": "health"}],
        "memory_categories": [{"memory_id": 7, "category_id": 3}],
    }
    result = memory_import_file(bob_scope, data=_openmemory(document), source="openmemory", call=internal_call())
    assert result.imported == 1
    (memory,) = _memories(bob_scope)
    assert (memory["client_app"], memory["tags"]) == ("claude", ["health"])


# --- REST: a coded 400, one audit row, nothing imported -------------------------------------------
def test_rest_import_of_bad_files_is_a_coded_400_audited_once(bob, api_client):
    _, bob_key = api_key_issue(user=bob, name="importer")
    client = api_client(bob_key)
    scope = MemoryScope.for_user(bob)
    for case, source, data, _named in BAD_FILES:
        before = len(_import_failures())
        response = client.post(f"/v1/memories/import?from={source}", data, content_type="application/octet-stream")
        assert response.status_code == 400, (case, response.content[:200])
        assert response["Content-Type"].startswith("application/json"), case
        error = response.json()["error"]
        assert error["code"] == "invalid_argument" and error["message"], case
        assert SECRET not in error["message"], case
        rows = _import_failures()[before:]
        assert len(rows) == 1, case
        assert (rows[0].outcome, rows[0].error_code) == ("error", "invalid_argument"), case
        _nothing_imported(scope)


def test_web_import_of_bad_files_says_nothing_was_imported(client, bob):
    client.force_login(bob)
    scope = MemoryScope.for_user(bob)
    for case, source, data, _named in BAD_FILES[:5]:
        upload = io.BytesIO(data)
        upload.name = "upload.bin"
        page = client.post("/data/import/", {"source": source, "file": upload}, follow=True)
        assert page.status_code == 200, case
        assert b"Nothing was imported: " in page.content, case
        assert SECRET.encode() not in page.content, case
        _nothing_imported(scope)
    assert [row.error_code for row in _import_failures()] == ["invalid_argument"] * 5


@pytest.mark.parametrize(
    ("with_file", "code", "message"),
    [(False, "invalid_argument", "choose a file to import"), (True, "payload_too_large", "the file exceeds 64 bytes")],
    ids=["no-file", "too-large"],
)
def test_web_import_refused_before_the_service_is_audited_once(client, settings, alice, bob, with_file, code, message):
    settings.IMPORT_MAX_BYTES = 64
    client.force_login(bob)
    form: dict = {"source": "memsite"}
    if with_file:
        form["file"] = io.BytesIO(json.dumps({"memory": SECRET * 10}).encode())
        form["file"].name = "memories.jsonl"
    page = client.post("/data/import/", form, follow=True)
    assert page.status_code == 200 and page.templates[0].name == "web/data.html"
    assert f"Nothing was imported: {message}".encode() in page.content
    (row,) = _import_failures()  # exactly one, and it is bob's
    assert (row.outcome, row.error_code, row.channel) == ("error", code, "ui")
    assert (row.actor_user_id, row.subject_user_id) == (bob.pk, bob.pk)
    assert content_open(row.detail["content"]) == {"message": message}  # the refusal, never the file's content
    assert not AuditEvent.objects.filter(subject_user_id=alice.pk).exists()
    _nothing_imported(MemoryScope.for_user(bob))


# --- REST refusals before the file is read are audited too ---------------------------------------
def test_rest_export_with_an_unknown_parameter_is_audited(alice, api_client):
    _, alice_key = api_key_issue(user=alice)
    response = api_client(alice_key).get("/v1/memories/export?foo=1")
    assert response.status_code == 400
    assert response.json()["error"] == {"code": "invalid_argument", "message": "unexpected query parameter 'foo'"}
    (row,) = AuditEvent.objects.filter(operation="export_memories")
    assert (row.outcome, row.error_code) == ("error", "invalid_argument")


@pytest.mark.parametrize(
    ("body", "content_type", "message"),
    [
        (  # a multipart body without the `file` field
            b'--XyZ\r\nContent-Disposition: form-data; name="other"\r\n\r\nhello\r\n--XyZ--\r\n',
            "multipart/form-data; boundary=XyZ",
            "send the file in the multipart field 'file'",
        ),
        (  # a boundary that matches no part
            b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\nhello\r\n--XyZ--\r\n',
            "multipart/form-data; boundary=Other",
            "send the file in the multipart field 'file'",
        ),
        (  # no boundary at all
            b"hello",
            "multipart/form-data",
            "Multipart form parse error - Invalid boundary in multipart: None",
        ),
    ],
    ids=["no-file-field", "boundary-matches-no-part", "no-boundary"],
)
def test_rest_import_of_an_unreadable_upload_is_audited(bob, api_client, body, content_type, message):
    _, bob_key = api_key_issue(user=bob)
    response = api_client(bob_key).generic("POST", "/v1/memories/import", body, content_type=content_type)
    assert response.status_code == 400, response.content[:200]
    assert response.json()["error"] == {"code": "invalid_argument", "message": message}
    (row,) = _import_failures()
    assert (row.outcome, row.error_code) == ("error", "invalid_argument")
    _nothing_imported(MemoryScope.for_user(bob))


# --- round trip: equal texts of different kinds, and null client apps ------------------------------
HUMAN_LONG = "I always prefer dark mode interfaces in every editor I use"


def test_round_trip_keeps_a_long_term_memory_beside_its_short_term_copy(alice):
    principal = Principal(user=alice, method="api_key", client_app="seed003-agent")
    messages = [{"role": "human", "content": HUMAN_LONG}, {"role": "ai", "content": "Noted, dark mode it is."}]
    operation_execute(principal, "store_memory", {"conversation_id": "c-1", "messages": messages}, call=internal_call())
    # Enriched before the export: an import enriches a pending candidate as it comes in.
    assert toolkit_candidates_enrich() == 1
    scope = MemoryScope.for_user(alice)  # no client app: the remembered memory's is null
    memory_remember(scope, memory="Alice takes her coffee black", call=internal_call())
    memory_remember(scope, memory="Alice works night shifts", fields={"memory_type": "project"}, call=internal_call())
    before = sorted((_comparable(m) for m in _memories(scope)), key=_order)
    assert len(before) == 5  # two short-term copies, the long-term one, two remembered
    assert [m["metadata"].get("tier") for m in before if m["memory"] == HUMAN_LONG] in (["ltm", "stm"], ["stm", "ltm"])
    exported = memory_export(scope, file_format="jsonl", call=internal_call()).content

    memory_clear_all(scope, confirm=True, call=internal_call())
    memory_purge(scope, call=internal_call())
    assert _memories(scope) == []
    result = memory_import_file(scope, data=exported.encode(), source="memsite", call=internal_call())
    assert (result.imported, result.duplicates, result.expired) == (5, 0, 0)
    after = sorted((_comparable(m) for m in _memories(scope)), key=_order)
    assert after == before  # both copies of the long message, every field, null client app kept
    coffee = next(m for m in after if m["memory"] == "Alice takes her coffee black")
    assert coffee["client_app"] is None
    # The long-term memory holds the text's dedupe hash, as before the export.
    (ltm,) = [m for m in _memories(scope) if m["memory"] == HUMAN_LONG and m["metadata"].get("tier") == "ltm"]
    assert ltm["expires_at"] is None
    assert ContentHash.objects.filter(memory_id=ltm["id"]).exists()

    again = memory_import_file(scope, data=exported.encode(), source="memsite", call=internal_call())
    assert (again.imported, again.duplicates) == (0, 5)  # importing the file twice adds nothing
    assert len(_memories(scope)) == 5


def test_equal_texts_of_one_kind_are_still_one_memory(bob_scope):
    records = [
        {"text": "Bob likes chess", "metadata": {"tier": "stm"}},
        {"text": "bob likes  CHESS", "metadata": {"tier": "stm"}},  # the same memory twice
        {"text": "Bob likes chess", "memory_type": "project"},  # another kind
    ]
    header = json.dumps({"format": "memsite.memories", "version": 1, "count": len(records)})
    data = "\n".join([header, *(json.dumps(r) for r in records)]).encode()
    result = memory_import_file(bob_scope, data=data, source="memsite", call=internal_call())
    assert (result.imported, result.duplicates) == (2, 1)
    assert sorted(m["memory_type"] for m in _memories(bob_scope)) == ["project", "user"]
    # The non-short-term one holds the hash, as `remember` would have made it.
    (owner,) = ContentHash.objects.filter(engine_user_id=bob_scope.engine_user_id)
    assert next(m for m in _memories(bob_scope) if m["id"] == str(owner.memory_id))["memory_type"] == "project"


def test_rest_import_keeps_null_client_apps_and_names_the_importer_for_foreign_files(alice, bob, api_client):
    scope = MemoryScope.for_user(alice)
    memory_remember(scope, memory="Alice takes her coffee black", call=internal_call())
    exported = memory_export(scope, file_format="jsonl", call=internal_call()).content
    _, bob_key = api_key_issue(user=bob, name="importer")
    client = api_client(bob_key)
    response = client.post("/v1/memories/import", exported.encode(), content_type="application/x-ndjson")
    assert response.status_code == 200 and response.json()["imported"] == 1
    mem0 = json.dumps({"results": [{"memory": "Bob has a cat"}]}).encode()
    response = client.post("/v1/memories/import?from=mem0", mem0, content_type="application/json")
    assert response.status_code == 200 and response.json()["imported"] == 1
    apps = {m["memory"]: m["client_app"] for m in _memories(MemoryScope.for_user(bob))}
    assert apps == {"Alice takes her coffee black": None, "Bob has a cat": "importer"}


def _comparable(memory: dict) -> dict:
    # Ids are new on import; the toolkit's `stm_id` link names the old short-term id.
    return {k: v for k, v in memory.items() if k != "id"} | {
        "metadata": {k: v for k, v in memory["metadata"].items() if k != "stm_id"}
    }


def _order(memory: dict) -> tuple:
    return (memory["memory"], str(memory["metadata"].get("tier")), memory["created_at"])


@pytest.mark.parametrize(
    "check",
    [
        lambda: portability._label("s\0", where="line 2 source"),
        lambda: portability._label("s\ud800", where="line 2 client_app"),
        lambda: portability._versions([{"event": "ADD", "old_memory": "a\0b"}], where="line 2"),
        lambda: portability._versions([{"event": "ADD", "changed_by": "x\ud800"}], where="line 2"),
    ],
    ids=["label-nul", "label-surrogate", "version-text-nul", "changed-by-surrogate"],
)
def test_stored_strings_are_checked_even_past_the_json_parser(check):
    """The JSON parser already refuses such strings anywhere in a file; the fields are
    checked again where they are taken, so no other route to them can store one."""
    with pytest.raises(ServiceError) as caught:
        check()
    assert caught.value.code == ErrorCode.INVALID_ARGUMENT
    assert "\0" not in caught.value.message and "\ud800" not in caught.value.message


def test_a_large_document_is_not_held_to_one_requests_value_cap():
    """json_loads_safe caps one value at 20,000 values; a mem0 file of thousands of
    memories holds many more and is bounded by its size instead."""
    records = [{"memory": f"fact number {n}", "metadata": {"n": n, "k": "v"}} for n in range(8_000)]
    data = json.dumps({"results": records}).encode()
    items = portability.import_items_parse(data=data, source="mem0", max_bytes=len(data), max_memories=20_000)
    assert len(items) == 8_000 and items[-1].metadata == {"n": 7_999, "k": "v"}
