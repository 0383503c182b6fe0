"""Review 18: a refused call consumes no rate window (F6), an OIDC client name an export
can carry back in (F5), import errors that name a metadata key by its place (F9), and
import/export progress an operator can follow (F10)."""

from __future__ import annotations

import dataclasses
import io
import json
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections, transaction

from audit.crypto import content_open
from audit.models import AuditEvent
from core.errors import ErrorCode, ServiceError
from core.scope import MemoryScope
from memories import rate_limits
from memories.management.commands._portability import ImportProgress, ProgressLine
from memories.models import RateEvent, RateWindow
from memories.rate_limits import rate_limit_consume
from memories.services import memory_export, memory_import_file, memory_list
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

SECRET = "sk-live-SECRETVALUE123"


# --- F6: a call refused by the user's limit leaves the credential's quota alone -------------
@pytest.fixture
def clock(monkeypatch):
    now = {"t": datetime(2026, 11, 22, 10, 52, tzinfo=UTC).timestamp()}
    monkeypatch.setattr(rate_limits, "clock", lambda: now["t"])
    return now


@pytest.fixture
def service(django_user_model):
    return django_user_model.objects.create_user("svc-bot")


def _via(service, user) -> MemoryScope:
    """`user`'s scope as a service credential acting for them."""
    return dataclasses.replace(MemoryScope.for_user(user), credential="svc", credential_user_pk=service.pk)


def _outcome(scope: MemoryScope) -> str:
    try:
        rate_limit_consume(scope, operation="remember")
    except ServiceError as exc:
        assert exc.code == ErrorCode.RATE_LIMITED
        return "rate_limited"
    return "ok"


@pytest.mark.parametrize("window", [3600, 60], ids=["sliding", "fixed"])
def test_a_call_refused_for_one_user_spends_nothing_of_the_credentials_quota(
    settings, clock, service, alice, bob, window
):
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "remember": (2, window)}
    settings.RATE_LIMIT_CREDENTIAL_FACTOR = 3  # the credential: 6 calls in all
    assert [_outcome(_via(service, alice)) for _ in range(8)] == ["ok", "ok"] + ["rate_limited"] * 6
    if window == 3600:
        assert RateEvent.objects.filter(user=service, operation="remember@svc").count() == 2
        assert RateEvent.objects.filter(user=alice, operation="remember").count() == 2
    else:
        assert RateWindow.objects.get(user=service, operation="remember@svc").count == 2
        assert RateWindow.objects.get(user=alice, operation="remember").count == 2
    # The credential still has 4 calls for its other users; bob's own limit allows 2.
    assert [_outcome(_via(service, bob)) for _ in range(3)] == ["ok", "ok", "rate_limited"]


@pytest.mark.parametrize("window", [3600, 60], ids=["sliding", "fixed"])
def test_a_call_refused_by_the_credential_spends_nothing_of_the_users_quota(
    settings, clock, service, alice, bob, django_user_model, window
):
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "remember": (2, window)}
    settings.RATE_LIMIT_CREDENTIAL_FACTOR = 2  # 4 calls in all
    carol = django_user_model.objects.create_user("carol")
    assert [_outcome(_via(service, user)) for user in (alice, alice, bob, bob)] == ["ok"] * 4
    assert _outcome(_via(service, carol)) == "rate_limited"  # the credential's limit
    # Carol's own window was not counted: her own calls (no credential) still get 2.
    assert [_outcome(MemoryScope.for_user(carol)) for _ in range(3)] == ["ok", "ok", "rate_limited"]


@pytest.mark.parametrize("window", [3600, 60], ids=["sliding", "fixed"])
def test_concurrent_refusals_never_leak_into_the_credentials_window(settings, clock, service, alice, window):
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "remember": (2, window)}
    settings.RATE_LIMIT_CREDENTIAL_FACTOR = 3
    scope = _via(service, alice)

    def call(_):
        try:
            return _outcome(scope)
        finally:
            connections.close_all()

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(call, range(16)))
    assert outcomes.count("ok") == 2
    if window == 3600:
        assert RateEvent.objects.filter(user=service).count() == 2
    else:
        assert RateWindow.objects.get(user=service).count == 2


def test_a_refusal_inside_the_callers_transaction_leaves_it_usable(settings, clock, service, alice):
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "remember": (1, 3600)}
    scope = _via(service, alice)
    with transaction.atomic():
        assert _outcome(scope) == "ok"
        assert _outcome(scope) == "rate_limited"  # rolled back to its savepoint only
        assert RateEvent.objects.count() == 2  # the first call's two rows stand
    assert RateEvent.objects.count() == 2


# --- F5: an OIDC client name longer than an import takes ------------------------------------
# 150: the export could not be imported (client_app over the import's cap); 300: the
# call itself failed, a 500 (over the audit row's actor_client_app column).
@pytest.mark.parametrize("length", [150, 300])
def test_a_long_oidc_azp_is_cut_so_the_export_imports(api_client, oidc, bob_scope, length):
    from memories.models import ExternalIdentity
    from memories.portability import LABEL_MAX_CHARS

    azp = "agent-" + "x" * (length - 6)
    client = api_client(oidc.token(sub="user-long-azp", aud="memsite", azp=azp))
    assert client.post("/v1/memories", {"memory": "Dana likes jazz"}, format="json").status_code == 201
    (listed,) = client.get("/v1/memories").json()["memories"]
    assert listed["client_app"] == azp[:LABEL_MAX_CHARS]

    dana = MemoryScope.for_user(ExternalIdentity.objects.get(subject="user-long-azp").user)
    exported = memory_export(dana, file_format="jsonl", call=internal_call())
    result = memory_import_file(bob_scope, data=exported.content.encode(), source="memsite", call=internal_call())
    assert result.imported == 1
    (imported,) = memory_list(bob_scope, call=internal_call()).memories
    assert imported.client_app == azp[:LABEL_MAX_CHARS]


# --- F9: errors name a metadata key by its place, never by the key itself --------------------
def _memsite_file(metadata: dict) -> bytes:
    header = {"format": "memsite.memories", "version": 1, "count": 2}
    records = [{"text": "first"}, {"text": "ok", "metadata": metadata}]
    return ("\n".join(json.dumps(r) for r in [header, *records]) + "\n").encode()


def _mem0_file(metadata: dict) -> bytes:
    return json.dumps({"results": [{"memory": "ok", "metadata": metadata}]}).encode()


BAD_METADATA = [
    # (metadata, code, what the message says instead of the key)
    ({"topic": "a", "b": 1, f"pw {SECRET}": "x"}, ErrorCode.INVALID_ARGUMENT, "metadata key #3 must be"),
    ({"topic": "a", f"pw_{SECRET}": {"nested": 1}}, ErrorCode.INVALID_ARGUMENT, "metadata key #2: the value must be"),
    ({f"pw_{SECRET}": "v" * 1001}, ErrorCode.PAYLOAD_TOO_LARGE, "the value of metadata key #1 exceeds"),
]


@pytest.mark.parametrize(("metadata", "code", "said"), BAD_METADATA, ids=["bad-key", "bad-value", "long-value"])
@pytest.mark.parametrize("source", ["memsite", "mem0"])
def test_import_errors_name_the_metadata_key_by_position(bob_scope, source, metadata, code, said):
    data = _memsite_file(metadata) if source == "memsite" else _mem0_file(metadata)
    with pytest.raises(ServiceError) as caught:
        memory_import_file(bob_scope, data=data, source=source, call=internal_call())
    assert caught.value.code == code
    assert SECRET not in caught.value.message
    assert said in caught.value.message, caught.value.message
    assert caught.value.message.startswith("line 3: " if source == "memsite" else "results[0]: ")


def test_the_failure_audit_row_holds_no_metadata_key(bob, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(_memsite_file({f"pw {SECRET}": "x"}))
    with pytest.raises(CommandError, match=r"invalid_argument: line 3: metadata: metadata key #1 must be"):
        call_command("import_memories", "bob", str(path))
    (row,) = AuditEvent.objects.filter(operation="import_memories", outcome="error")
    opened = content_open(row.detail["content"])  # sealed, but readable to whoever holds the key
    assert "metadata key #1" in opened["message"] and SECRET not in opened["message"]


@pytest.mark.parametrize(
    ("body", "code", "said"),
    [
        ({"memory": "ok", "metadata": {f"pw {SECRET}": "x"}}, "invalid_argument", "metadata key #1 must be"),
        ({"memory": "ok", "metadata": {f"pw_{SECRET}": [1]}}, "invalid_argument", "metadata key #1: the value"),
        ({"memory": "ok", "metadata": {f"pw_{SECRET}": "v" * 1001}}, "payload_too_large", "metadata key #1 exceeds"),
        ({"memory": "ok", "metadata": {"a": 1, "source": "x"}}, "invalid_argument", "metadata key #2 ('source') is"),
    ],
)
def test_remember_keeps_its_codes_and_names_keys_by_position(api_client, alice_key, body, code, said):
    response = api_client(alice_key).post("/v1/memories", body, format="json")
    assert response.status_code in (400, 413), response.content
    error = response.json()["error"]
    assert error["code"] == code and said in error["message"], error
    assert SECRET not in error["message"]


def test_search_filters_name_keys_by_position(api_client, alice_key):
    for filters in ({f"pw {SECRET}": "x"}, {f"pw_{SECRET}": [1]}, {f"pw_{SECRET}": "v" * 1001}):
        response = api_client(alice_key).post("/v1/memories/search", {"query": "q", "filters": filters}, format="json")
        error = response.json()["error"]
        assert error["code"] in ("invalid_argument", "payload_too_large") and "filters key #1" in error["message"]
        assert SECRET not in error["message"], error


def test_a_bad_value_under_a_metadata_key_is_placed_by_position_not_by_the_key(api_client, alice_key):
    """The input check that runs before the schema (control characters, NaN) walks nested
    objects; it names the caller's keys by their position too."""
    body = {"memory": "a fact", "metadata": {"fine": "x", f"pw_{SECRET}": "bell \u0007"}}
    response = api_client(alice_key).post("/v1/memories", body, format="json")
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "invalid_argument", error
    assert "metadata.#2" in error["message"] and SECRET not in error["message"], error


# --- F10: progress while importing and exporting --------------------------------------------
def test_progress_prints_when_the_count_passes_a_step():
    out = io.StringIO()
    progress = ProgressLine("import", noun="texts", stream=out)
    for done in [*range(64, 1000, 64), 1000]:  # batches of 64, as the import embeds
        progress(done, 1000)
    assert out.getvalue().splitlines() == [
        f"import: {n}/1000 texts" for n in (128, 256, 320, 448, 512, 640, 704, 832, 960, 1000)
    ]


def test_import_progress_says_when_the_write_starts():
    out = io.StringIO()
    progress = ImportProgress(stream=out)
    for done in (64, 128, 130):
        progress(done, 130)
    assert out.getvalue().splitlines() == [
        "import: 128/130 new texts embedded",
        "import: 130/130 new texts embedded",
        "import: writing the new memories (one transaction)",
    ]


def test_manage_py_import_and_export_say_each_phase(bob, tmp_path, capsys):
    header = {"format": "memsite.memories", "version": 1, "count": 130}
    records = [{"text": f"fact number {n} about the quokka-{n}"} for n in range(130)]
    path = tmp_path / "many.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [header, *records]) + "\n")

    call_command("import_memories", "bob", str(path))
    captured = capsys.readouterr()
    assert "imported 130 memories" in captured.out
    assert captured.err.splitlines() == [
        "import: validating many.jsonl",
        "import: checking 130 records against the memories of 'bob'",
        "import: 128/130 new texts embedded",
        "import: 130/130 new texts embedded",
        "import: writing the new memories (one transaction)",
    ]
    assert "quokka" not in captured.err

    # A re-import (every text already there) still says what it does.
    call_command("import_memories", "bob", str(path))
    captured = capsys.readouterr()
    assert "imported 0 memories" in captured.out and "130 already there" in captured.out
    assert captured.err.splitlines() == [
        "import: validating many.jsonl",
        "import: checking 130 records against the memories of 'bob'",
        "import: no new texts to embed",
        "import: writing the new memories (one transaction)",
    ]

    call_command("export_memories", "bob", "-o", str(tmp_path / "out.jsonl"))
    err = capsys.readouterr().err
    assert "export: reading the memories of 'bob'" in err and "export: 130/130 memories written" in err
