"""Chat turns' (state, created_at) index held an entry per turn, nearly all of them
extracted ("done") turns that no query reads through it: its readers want the pending
ones (the sweep, oldest first; the /metrics gauges of how many and the oldest's age; the
admin's state filter) or the failed ones (the gauge of turns given up, the admin's state
filter). It becomes two partial indexes, newest first as the admin lists (the sweep reads
one backwards), as small as the turns owed work or a person.

The prune took closed turns in id order with no index on their close time: each batch
walked the primary key from the start, through every pending and recent turn older than
the first prunable one. It now reads closed turns by close time from an index of them
(as ingest intents' ingest_intent_closed_at, memories 0033).

Built before the old index goes, so the sweep always has one. CONCURRENTLY (hence
`atomic = False`): the table gains a row per proxied chat call, and a plain CREATE or DROP
INDEX would block every one of them until it had finished."""

from django.contrib.postgres.operations import AddIndexConcurrently, RemoveIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("proxy", "0007_request_id_unique_constraint"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="proxyturn",
            index=models.Index(
                fields=["-created_at", "-id"], condition=models.Q(state="pending"), name="proxy_turn_pending"
            ),
        ),
        AddIndexConcurrently(
            model_name="proxyturn",
            index=models.Index(
                fields=["-created_at", "-id"], condition=models.Q(state="failed"), name="proxy_turn_failed"
            ),
        ),
        AddIndexConcurrently(
            model_name="proxyturn",
            index=models.Index(fields=["closed_at"], condition=~models.Q(state="pending"), name="proxy_turn_closed_at"),
        ),
        RemoveIndexConcurrently(model_name="proxyturn", name="proxy_turn_due"),
    ]
