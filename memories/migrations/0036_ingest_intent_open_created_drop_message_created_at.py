"""Two indexes every ingest call paid entries in for rows nothing reads through them:

- ingest intents' (state, created_at): its only readers are the reconciler (the open ones
  older than the lease) and the /metrics gauge (how many are open, the oldest one's age),
  both of the open rows alone. Every other query on the table has its own index (the
  request id's, memories 0032; a user's open or closed ones and the closed ones by close
  time, memories 0033). It becomes (created_at) over the open rows only, as small as the
  calls in flight, built before the old one goes so the reconciler always has one.
- mem0's raw messages' (created_at), from `db_index` in memories 0001: every read and the
  trim after each save take one session's rows (engine_message_scope) and order only
  those; no query ranges over every session's messages by time (not the purges, which go
  by user id; the table has no admin and no export).

Built and dropped CONCURRENTLY (hence `atomic = False`): both tables gain rows per ingest
call, and a plain CREATE or DROP INDEX would block every ingest until it had finished."""

from django.contrib.postgres.operations import AddIndexConcurrently, RemoveIndexConcurrently
from django.db import migrations, models

MESSAGES = "memories_enginemessage"
MESSAGE_CREATED = "memories_enginemessage_created_at_12135435"  # Django's name for it in memories 0001


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("memories", "0035_session_context_summary"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="ingestintent",
            index=models.Index(
                fields=["created_at"], condition=models.Q(state="open"), name="ingest_intent_open_created"
            ),
        ),
        RemoveIndexConcurrently(model_name="ingestintent", name="memories_in_state_2de30d_idx"),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(model_name="enginemessage", name="created_at", field=models.DateTimeField()),
            ],
            database_operations=[
                migrations.RunSQL(
                    f"DROP INDEX CONCURRENTLY IF EXISTS {MESSAGE_CREATED}",
                    reverse_sql=f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {MESSAGE_CREATED} ON {MESSAGES} (created_at)",
                ),
            ],
        ),
    ]
