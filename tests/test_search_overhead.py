"""Per-search Python overhead (issue 19): a memory view becomes a dict without
dataclasses.asdict."""

from dataclasses import asdict
from datetime import UTC, datetime

import pytest

from memories.selectors import MemoryView


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
