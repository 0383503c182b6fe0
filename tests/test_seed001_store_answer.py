"""Seed 001's store answers the memory it stored, read back after the call. A memory whose
`expires_at` passed during the call (a slow embedding) was hidden from that read: the
client got 404 for a store that succeeded and was billed."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

from billing.models import UsageEvent
from memories import services
from memories.services import api_key_issue

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def test_a_memory_that_expired_during_its_store_is_answered_as_stored(api_client, alice, monkeypatch):
    client = api_client(api_key_issue(user=alice, name="store")[1])
    embed = services.engine_embed_text
    assert client.post("/v1/memory", {"content": "A warm-up store"}, format="json").status_code == 201

    def slow(text):
        time.sleep(4)  # past the expiry below
        return embed(text)

    monkeypatch.setattr(services, "engine_embed_text", slow)
    soon = (datetime.now(UTC) + timedelta(seconds=3)).isoformat()
    answer = client.post("/v1/memory", {"content": "Alice's parking spot is B4", "expires_at": soon}, format="json")
    assert answer.status_code == 201, answer.content
    assert answer.json()["memory"]["content"] == "Alice's parking spot is B4"
    assert list(UsageEvent.objects.values_list("operation", flat=True)) == ["remember"] * 2
    assert client.get(f"/v1/memory/{answer.json()['memory']['id']}").status_code in (404, 405)  # gone for reads
