"""Per-search Python overhead (issue 19): a memory view becomes a dict without
dataclasses.asdict, and the statements that depend only on the table and the embedder are
rendered once, never stale after a re-embedding switch."""

from dataclasses import asdict
from datetime import UTC, datetime

import pytest
from django.db import connection
from psycopg import sql

from memories.engine import retrieval
from memories.engine.embedders import embedder_spec_refresh
from memories.models import EmbedderState
from memories.selectors import MemoryView
from memories.services import memory_remember, memory_search
from tests.conftest import internal_call


def _view(**overrides) -> MemoryView:
    fields = {
        "id": "3f0c7a52-1d1e-4c55-9d4e-2f9b1a6c0e11",
        "memory": "The staging box answers on 10.20.30.41.",
        "pinned": True,
        "metadata": {
            "project": "atlas",
            "nested": {"levels": [1, {"deep": ["a", "b"]}], "flag": False, "none": None},
            "when": datetime(2026, 11, 28, 6, 0, tzinfo=UTC),
            "ratio": 0.25,
        },
        "source": "mcp",
        "client_app": "claude",
        "created_at": "2026-11-28T06:00:00+00:00",
        "updated_at": "2026-11-28T06:05:00+00:00",
        "memory_type": "fact",
        "tags": ["infra", "staging"],
        "importance": 0.7,
        "agent_id": "agent-1",
        "session_id": "session-9",
        "expires_at": "2027-01-01T00:00:00+00:00",
        "why_stored": "asked to remember",
        "last_recalled_at": "2026-11-28T06:10:00+00:00",
        "access_count": 3,
        "score": 0.83,
    }
    return MemoryView(**{**fields, **overrides})


def _asdict_view(view: MemoryView) -> dict:
    """What as_dict used to return."""
    data = asdict(view)
    if view.score is None:
        data.pop("score")
    return data


VIEWS = {
    "everything set": _view(),
    "nones and empties": _view(
        metadata={},
        tags=[],
        source=None,
        client_app=None,
        created_at=None,
        updated_at=None,
        agent_id=None,
        session_id=None,
        expires_at=None,
        why_stored=None,
        last_recalled_at=None,
        score=None,
    ),
    "score zero": _view(score=0.0, pinned=False, access_count=0),
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_a_memory_view_as_dict_is_what_dataclasses_asdict_made(name):
    view = VIEWS[name]
    data = view.as_dict()
    expected = _asdict_view(view)
    assert data == expected
    assert list(data) == list(expected)  # the same keys in the same order (JSON output)
    assert {key: type(value) for key, value in data.items()} == {key: type(value) for key, value in expected.items()}


def test_changing_a_memory_views_dict_leaves_the_view_as_it_was():
    view = _view()
    before = _asdict_view(view)
    data = view.as_dict()
    data["metadata"]["project"] = "changed"
    data["metadata"]["nested"]["levels"][1]["deep"].append("c")
    data["metadata"]["nested"]["flag"] = True
    data["tags"].append("new")
    assert _asdict_view(view) == before
    assert view.as_dict() == before


# --- Rendered statements ---------------------------------------------------------------


@pytest.fixture
def renders(monkeypatch) -> list[str]:
    """Every composed statement rendered from here on, from an empty statement cache."""
    monkeypatch.setattr(retrieval, "_rendered_statements", {}, raising=False)
    rendered: list[str] = []
    as_string = sql.Composed.as_string

    def spy(self, context=None):
        text = as_string(self, context)
        rendered.append(text)
        return text

    monkeypatch.setattr(sql.Composed, "as_string", spy)
    return rendered


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_vectors")
def test_searches_render_their_statements_once(alice_scope, settings, renders):
    settings.SEARCH_FUSION = "score"
    settings.SEARCH_LEXICAL_CONCURRENT = True
    for text in ("I adopted a dog last spring.", "His name is Max.", "Max loves the beach."):
        memory_remember(alice_scope, memory=text, call=internal_call())
    for query in ("What is my dog called?", "Where does Max like to go?", "dog"):
        assert memory_search(alice_scope, query=query, top_k=5, call=internal_call())
    assert sum("LEFT JOIN LATERAL" in text for text in renders) == 1
    assert sum(text.startswith("SELECT id, -(vector <#> %s::vector)") for text in renders) == 1
    # The vector and BM25 statements too, once per shape (here: one term, then two).
    assert sum("count(*) OVER ()" in text for text in renders) == 1
    renders.clear()
    for query in ("Where does Max like to go?", "dog", "beach", "my dog"):
        assert memory_search(alice_scope, query=query, top_k=5, call=internal_call())
    assert [text[:60] for text in renders] == []


@pytest.mark.django_db(transaction=True)
def test_a_rendered_statement_follows_the_table_and_the_embedder(settings):
    retrieval._rendered_statements.clear()
    with connection.cursor() as cursor:
        local = retrieval._rendered_statement("neighbours", cursor, retrieval._neighbours_statement)
        local_key = retrieval._statement_key("neighbours", cursor)
        assert '"memories"' in local and "<#>" in local and "<=>" not in local

        # A re-embedding switch records another embedder: its vectors are not unit length.
        EmbedderState.objects.create(pk=1, name="gemini", dims=768)
        embedder_spec_refresh()
        try:
            switched_key = retrieval._statement_key("neighbours", cursor)
            switched = retrieval._rendered_statement("neighbours", cursor, retrieval._neighbours_statement)
            similarities = retrieval._rendered_statement("similarities", cursor, retrieval._similarities_statement)
        finally:
            EmbedderState.objects.all().delete()
            embedder_spec_refresh()
        assert switched_key != local_key
        assert "<=>" in switched and "<#>" not in switched and "1 - (vector <=> %s::vector)" in switched
        assert similarities == 'SELECT id, 1 - (vector <=> %s::vector) FROM "memories" WHERE id = ANY(%s::uuid[])'

        settings.MEMORY_COLLECTION = "memories_next"
        other_key = retrieval._statement_key("neighbours", cursor)
        other = retrieval._rendered_statement("neighbours", cursor, retrieval._neighbours_statement)
        assert other_key != local_key
        assert '"memories_next"' in other and '"memories"' not in other

        settings.MEMORY_COLLECTION = "memories"
        assert retrieval._rendered_statement("neighbours", cursor, retrieval._neighbours_statement) == local
