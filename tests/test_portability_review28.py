"""Review 28 (portability): what the toolkit's enrichment writes imports again; an
import never makes toolkit candidates for the enrichment sweep; real mem0 exports come
in whole, with their expiry, agent and run, who said each memory, and every metadata key
memsite reserves renamed `mem0_<key>`."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from core.errors import ErrorCode, ServiceError
from core.scope import CallContext
from memories import schemas
from memories.auth import Principal
from memories.operations import operation_execute
from memories.services import memory_export, memory_import_file
from memories.toolkit import enrichment
from memories.toolkit.services import toolkit_candidates_enrich
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

FLIGHTS = "I prefer window seats on long flights to Asia."


@pytest.fixture(autouse=True)
def _no_limits(settings):
    settings.RATE_LIMITS = {k: (0, 60) for k in settings.RATE_LIMITS}


def run(user, name, **arguments):
    return operation_execute(Principal(user=user, method="api_key"), name, arguments, call=CallContext(channel="mcp"))


def _export(scope) -> str:
    return memory_export(scope, file_format="jsonl", call=internal_call()).content


def _import(scope, content: str | bytes, source: str = "memsite"):
    data = content.encode() if isinstance(content, str) else content
    return memory_import_file(scope, data=data, source=source, call=internal_call())


def _all(user) -> list[dict]:
    return run(user, "list_memory", page_size=200)["memories"]


def _ltm(user) -> dict:
    return next(m for m in _all(user) if m["metadata"].get("tier") == "ltm")


def _store(user, text: str = FLIGHTS) -> None:
    run(user, "store_memory", conversation_id="c1", messages=[{"role": "human", "content": text}])


def _answer(tags: list) -> dict:
    return {"summary": "Prefers window seats", "importance": 0.7, "tags": tags, "memory_type": "user"}


# --- 1: the LLM's tags -----------------------------------------------------------------------------
DOTTED_I = "\u0130"  # "İ": its lowercase form is two characters, "i" and a combining dot


def test_llm_tags_with_control_characters_or_growing_in_lowercase_export_and_import(
    alice, bob, alice_scope, bob_scope, llm
):
    llm.queue_answer(_answer(["work\tstuff", DOTTED_I * 64, "Line\r\nBreak", "ok"]))
    _store(alice)
    assert toolkit_candidates_enrich() == 1
    assert _import(bob_scope, _export(alice_scope)).imported == 2  # the long-term memory and its short-term copy
    tags = _ltm(alice)["tags"]
    assert tags == ["work stuff", "i\u0307" * 32, "line break", "ok"]
    assert _ltm(bob)["tags"] == tags


def test_llm_tags_that_are_no_tag_once_cleaned_are_dropped(llm):
    llm.queue_answer(_answer(["\x00\x01", "\t\n", "Tab\tand\n\nnewline", "\x1f" + "x" * 70, "Ok", "OK "]))
    assert enrichment.enrich_text(FLIGHTS).tags == ["tab and newline", "x" * 64, "ok"]


def test_llm_tags_never_name_the_turn_lifecycles_own_tags(llm):
    """The memory's text steers the LLM: a tag `turn-fact`, `tier:...` or `project:...`
    would make a toolkit memory a turn fact (consolidated, deleted by retention)."""
    llm.queue_answer(_answer(["Turn-Fact", "tier:l1", "project:x", "travel"]))
    assert enrichment.enrich_text(FLIGHTS).tags == ["travel"]
    # Nor the heuristics' (the sweep's fallback, and every imported pending candidate's).
    tags = enrichment.enrich_heuristic("Our agents tag extracted facts turn-fact; the turn-fact tag marks them.").tags
    assert "turn-fact" not in tags and "agents" in tags


# --- 2: an import makes no toolkit candidates ------------------------------------------------------
def _file(records: list[dict]) -> str:
    header = {"format": "memsite.memories", "version": 1, "count": len(records)}
    return "\n".join(json.dumps(r) for r in [header, *records]) + "\n"


def _forged(n: int) -> dict:
    return {
        "text": f"Forged long-term candidate number {n}, long enough to be one.",
        "source": "store_memory",
        "metadata": {"tier": "ltm", "enrichment_status": "pending"},
        "created_at": "2000-01-01T00:00:00Z",
    }


def test_imported_pending_candidates_cost_no_llm_call_and_do_not_delay_anyone(alice, bob, bob_scope, llm):
    assert _import(bob_scope, _file([_forged(n) for n in range(6)])).imported == 6
    _store(alice)
    llm.queue_answer(_answer(["travel"]))
    # The sweep takes the oldest pending candidate first: Alice's, the only one there is.
    assert toolkit_candidates_enrich(limit=1) == 1
    assert _ltm(alice)["metadata"]["enriched_by"] == "llm"
    assert toolkit_candidates_enrich() == 0
    assert len(llm.prompts()) == 1
    # Bob's rows were settled by the import, with the heuristics (no LLM call, no wait).
    for memory in _all(bob):
        expected = enrichment.enrich_heuristic(memory["memory"])
        assert memory["metadata"] == {
            "tier": "ltm",
            "enrichment_status": "completed",
            "enriched_by": "heuristic",
            "summary": expected.summary,
        }
        assert (memory["tags"], memory["importance"]) == (expected.tags, expected.importance)


def test_an_export_of_enriched_toolkit_rows_imports_with_their_enrichment(alice, bob, alice_scope, bob_scope, llm):
    llm.queue_answer(_answer(["travel", "flights"]))
    _store(alice)
    assert toolkit_candidates_enrich() == 1
    assert _import(bob_scope, _export(alice_scope)).imported == 2
    mine, copy = _ltm(alice), _ltm(bob)
    assert copy["metadata"]["enriched_by"] == "llm" and copy["metadata"]["summary"] == "Prefers window seats"
    assert (copy["tags"], copy["importance"], copy["memory_type"]) == (mine["tags"], 0.7, "user")
    assert toolkit_candidates_enrich() == 0
    assert len(llm.prompts()) == 1


def test_an_export_of_a_pending_candidate_imports_enriched_by_the_heuristics(alice, bob, alice_scope, bob_scope, llm):
    _store(alice)
    assert _ltm(alice)["metadata"]["enrichment_status"] == "pending"
    assert _import(bob_scope, _export(alice_scope)).imported == 2
    copy = _ltm(bob)
    assert copy["metadata"]["enrichment_status"] == "completed"
    assert copy["metadata"]["enriched_by"] == "heuristic"
    assert copy["tags"] == enrichment.enrich_heuristic(FLIGHTS).tags
    # Still a pair: deleting the short-term row deletes the long-term one too.
    stm = next(m for m in _all(bob) if m["metadata"].get("tier") == "stm")
    assert copy["metadata"]["stm_id"] == stm["id"]
    assert toolkit_candidates_enrich(memory_ids=[copy["id"]]) == 0
    assert llm.prompts() == []


# --- 3: mem0 files ------------------------------------------------------------------------------------
def _mem0(*records: dict) -> bytes:
    """A file as mem0 2.2's `get_all` writes it: the payload's own keys at the top, the rest
    (its procedural memories' `memory_type` too) under `metadata`."""
    base = {"hash": "0123456789abcdef0123456789abcdef", "created_at": "2025-05-20T18:00:00-07:00", "user_id": "dana"}
    return json.dumps({"results": [base | {"id": f"m{n}"} | r for n, r in enumerate(records)]}).encode()


def _by_text(user) -> dict[str, dict]:
    return {m["memory"]: m for m in _all(user)}


def test_a_mem0_export_with_procedural_memories_expiry_agent_and_run_imports_them(bob, bob_scope):
    today = datetime.now(UTC).date()
    data = _mem0(
        {"memory": "Books aisle seats", "agent_id": "travel-agent", "run_id": "run-42", "expiration_date": "2999-12-31",
         "metadata": {"category": "travel"}},
        {"memory": "Step 1: run the linter", "agent_id": "coder", "metadata": {"memory_type": "procedural_memory"}},
        {"memory": "Is in Lisbon this week", "expiration_date": today.isoformat(), "agent_id": None, "run_id": None},
        {"memory": "Was in Porto last year", "expiration_date": "2001-01-01"},
    )  # fmt: skip
    result = _import(bob_scope, data, "mem0")
    assert (result.imported, result.expired) == (3, 1)  # an expired one is left out, as a memsite file's
    memories = _by_text(bob)
    seats = memories["Books aisle seats"]
    assert (seats["agent_id"], seats["session_id"]) == ("travel-agent", "run-42")
    # mem0 shows a memory through its expiration date (UTC): it expires at that day's end.
    assert seats["expires_at"] == "2999-12-31T23:59:59.999999+00:00"
    assert seats["metadata"] == {"category": "travel"}
    procedure = memories["Step 1: run the linter"]
    assert procedure["metadata"] == {"mem0_memory_type": "procedural_memory"}
    assert (procedure["agent_id"], procedure["session_id"], procedure["expires_at"]) == ("coder", None, None)
    assert memories["Is in Lisbon this week"]["expires_at"] == f"{today.isoformat()}T23:59:59.999999+00:00"
    assert "Was in Porto last year" not in memories


def test_every_metadata_key_memsite_reserves_comes_in_renamed_from_a_mem0_file(bob, bob_scope):
    """mem0 reserves none of them: a `source` or `pinned` there is the owner's own label,
    and refusing it refused the whole file. Each comes in as `mem0_<key>` and changes
    nothing memsite keeps under that name."""
    reserved = sorted(schemas.RESERVED_KEYS)
    chunks = [reserved[start : start + 10] for start in range(0, len(reserved), 10)]  # within the 20-key budget
    data = _mem0(
        *({"memory": f"Labelled memory number {n}", "metadata": {"category": "x"} | {key: f"v-{key}" for key in chunk}}
          for n, chunk in enumerate(chunks)),
        {"memory": "Pinned in mem0", "metadata": {"pinned": True, "source": "slack", "mem0_note": "kept"}},
    )  # fmt: skip
    assert _import(bob_scope, data, "mem0").imported == len(chunks) + 1
    memories = _by_text(bob)
    for n, chunk in enumerate(chunks):
        memory = memories[f"Labelled memory number {n}"]
        assert memory["metadata"] == {"category": "x"} | {f"mem0_{key}": f"v-{key}" for key in chunk}
        assert (memory["source"], memory["pinned"], memory["memory_type"]) == ("mem0", False, "user")
        assert (memory["agent_id"], memory["session_id"], memory["expires_at"]) == (None, None, None)
    pinned = memories["Pinned in mem0"]
    assert pinned["metadata"] == {"mem0_pinned": True, "mem0_source": "slack", "mem0_note": "kept"}
    assert (pinned["source"], pinned["pinned"]) == ("mem0", False)


def test_who_said_a_mem0_memory_comes_in_as_metadata(bob, bob_scope):
    """mem0's `get_all` gives a verbatim message's `role` and `actor_id` (its `name`) and an
    extracted fact's `attributed_to` beside the memory, not in its metadata: they came in
    nowhere. mem0's `hash` (md5 of the text) is not kept: the engine makes it again."""
    data = _mem0(
        {"memory": "Take the night train", "role": "assistant", "actor_id": "travel-bot",
         "updated_at": "2025-05-20T18:00:00-07:00", "metadata": {"category": "travel"}},
        {"memory": "I get seasick on ferries", "role": "user", "actor_id": None},
        {"memory": "Prefers trains to planes", "attributed_to": "user", "agent_id": "travel-bot",
         "metadata": {"source": "chat"}},
        # Given in `metadata` too (renamed as every reserved key) with the same value: one key.
        {"memory": "Booked a sleeper cabin", "role": "assistant", "metadata": {"role": "assistant"}},
        {"memory": "Has no speaker", "role": "", "actor_id": "", "attributed_to": None},
    )  # fmt: skip
    assert _import(bob_scope, data, "mem0").imported == 5
    metadata = {text: memory["metadata"] for text, memory in _by_text(bob).items()}
    assert metadata == {
        "Take the night train": {"category": "travel", "mem0_actor_id": "travel-bot", "mem0_role": "assistant"},
        "I get seasick on ferries": {"mem0_role": "user"},
        "Prefers trains to planes": {"mem0_source": "chat", "mem0_attributed_to": "user"},
        "Booked a sleeper cabin": {"mem0_role": "assistant"},
        "Has no speaker": {},
    }
    assert _by_text(bob)["Prefers trains to planes"]["agent_id"] == "travel-bot"


def _at_byte_budget() -> dict:
    """Metadata of exactly METADATA_MAX_BYTES as JSON."""
    metadata = {f"n{n}": "x" * 900 for n in range(9)}
    metadata["n8"] += "x" * (schemas.METADATA_MAX_BYTES - schemas.metadata_json_bytes(metadata))
    assert schemas.metadata_json_bytes(metadata) == schemas.METADATA_MAX_BYTES
    return metadata


def test_who_said_a_mem0_memory_rides_on_top_of_its_own_full_metadata_and_stays_editable(
    alice, bob, alice_scope, bob_scope
):
    """The speaker fields came in as keys counted in the owner's 20 keys and 8 KiB: a mem0
    memory with 19 or 20 keys of its own and a `role` refused the whole (valid) file. They
    are outside that budget, as the enrichment's keys are, on import, on update (the owner
    keeps 20 keys of their own) and when the memory's memsite export is imported again."""
    full = {f"k{n}": n for n in range(19)} | {"source": "slack"}  # 20 keys, one of them renamed
    speaker = {"role": "assistant", "actor_id": "travel-bot", "attributed_to": "user"}
    data = _mem0(
        {"memory": "Twenty keys and a speaker", "metadata": full} | speaker,
        {"memory": "Nineteen keys and a role", "role": "user", "metadata": {f"k{n}": n for n in range(19)}},
        {"memory": "A full byte budget and a speaker", "metadata": _at_byte_budget()}
        | speaker | {"actor_id": "a" * 1000},
    )  # fmt: skip
    assert _import(bob_scope, data, "mem0").imported == 3
    memories = _by_text(bob)
    twenty = memories["Twenty keys and a speaker"]
    assert twenty["metadata"] == {f"k{n}": n for n in range(19)} | {
        "mem0_source": "slack", "mem0_actor_id": "travel-bot", "mem0_role": "assistant", "mem0_attributed_to": "user"
    }  # fmt: skip
    assert memories["Nineteen keys and a role"]["metadata"]["mem0_role"] == "user"
    assert memories["A full byte budget and a speaker"]["metadata"]["mem0_actor_id"] == "a" * 1000

    # Editable as any memory: its own keys change, the 19-key one takes a 20th, not a 21st.
    assert (
        run(bob, "update_memory", memory_id=twenty["id"], metadata={"k0": "changed"})["memory"]["metadata"]["k0"]
        == "changed"
    )
    nineteen = memories["Nineteen keys and a role"]["id"]
    assert run(bob, "update_memory", memory_id=nineteen, metadata={"k19": 19})["memory"]["metadata"]["k19"] == 19
    with pytest.raises(ServiceError) as over:
        run(bob, "update_memory", memory_id=nineteen, metadata={"k20": 20})
    assert over.value.code == ErrorCode.PAYLOAD_TOO_LARGE
    assert "k20" not in _by_text(bob)["Nineteen keys and a role"]["metadata"]

    # Its memsite export imports again, into another user's data; bob's stays as it was.
    before = _by_text(bob)
    assert _import(alice_scope, _export(bob_scope)).imported == 3
    assert {t: m["metadata"] for t, m in _by_text(alice).items()} == {t: m["metadata"] for t, m in before.items()}
    assert _by_text(bob) == before


INVALID, TOO_LARGE = ErrorCode.INVALID_ARGUMENT, ErrorCode.PAYLOAD_TOO_LARGE


@pytest.mark.parametrize(
    ("record", "named", "code"),
    [
        ({"agent_id": "travel agent"}, "results[1]: agent_id", INVALID),
        ({"run_id": 42}, "results[1]: run_id", INVALID),
        ({"run_id": "r" * 129}, "results[1]: run_id", TOO_LARGE),
        ({"expiration_date": "next week"}, "results[1] expiration_date", INVALID),
        ({"expiration_date": 20261231}, "results[1] expiration_date", INVALID),
        ({"metadata": {"memory_type": "a", "mem0_memory_type": "b"}}, "results[1]: metadata: metadata key #1", INVALID),
        ({"metadata": {"n": 1, "source": "a", "mem0_source": "b"}},
         "results[1]: metadata: metadata key #2 ('source') is reserved, and its new name 'mem0_source'", INVALID),
        ({"metadata": {"my key": "a"}}, "results[1]: metadata: metadata key #1 must be", INVALID),
        ({"role": ["user"]}, "results[1] role must be text", INVALID),
        ({"actor_id": "a" * 1001}, "results[1] actor_id exceeds 1000 characters", TOO_LARGE),
        ({"attributed_to": "user", "metadata": {"mem0_attributed_to": "assistant"}},
         "results[1] attributed_to comes in as metadata key 'mem0_attributed_to'", INVALID),
        # The record's own keys (renamed ones too) have `remember`'s 20; its speaker rides on top.
        ({"role": "user", "metadata": {f"k{n}": n for n in range(21)}}, "results[1]: metadata", TOO_LARGE),
        ({"metadata": {f"k{n}": n for n in range(20)} | {"source": "x"}}, "results[1]: metadata", TOO_LARGE),
    ],
)  # fmt: skip
def test_a_mem0_file_with_a_bad_scope_expiry_or_key_is_refused_whole(bob, bob_scope, record, named, code):
    with pytest.raises(ServiceError) as refused:
        _import(bob_scope, _mem0({"memory": "A good one"}, {"memory": "Secret words"} | record), "mem0")
    assert refused.value.code == code and refused.value.message.startswith(named)
    assert "Secret" not in refused.value.message
    assert _all(bob) == []
