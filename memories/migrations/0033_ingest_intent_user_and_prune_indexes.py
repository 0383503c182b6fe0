"""Ingest intents are read by user and, now, pruned by age (`ingest_intents_prune`):
- a user's open ones (the calls in flight an erasure or clear-all marks and its undo
  unmarks, in pk order): an index of the open rows only, as small as the calls in flight;
- a user's closed ones, which the erasure deletes;
- the closed ones by the time they closed, which the prune deletes past
  INGEST_INTENT_RETENTION_DAYS.
Each of those read the whole table before. The (state, created_at) index stays beside
them: the reconciler and the /metrics gauge read every user's open ones by age.

Built CONCURRENTLY (hence `atomic = False`): the table gains a row per ingest call, and a
plain CREATE INDEX would block every ingest while it builds."""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models

CLOSED = ~models.Q(state="open")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("memories", "0032_per_call_plain_indexes"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="ingestintent",
            index=models.Index(
                fields=["engine_user_id", "id"], condition=models.Q(state="open"), name="ingest_intent_user_open"
            ),
        ),
        AddIndexConcurrently(
            model_name="ingestintent",
            index=models.Index(fields=["engine_user_id"], condition=CLOSED, name="ingest_intent_user_closed"),
        ),
        AddIndexConcurrently(
            model_name="ingestintent",
            index=models.Index(fields=["closed_at"], condition=CLOSED, name="ingest_intent_closed_at"),
        ),
    ]
