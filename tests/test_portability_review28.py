"""Review 28 (portability): what the toolkit's enrichment writes imports again; an
import never makes toolkit candidates for the enrichment sweep; real mem0 exports come
in whole, with their expiry, agent and run."""

from __future__ import annotations

import pytest

from core.scope import CallContext
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
