"""Sliding-window calls (RateEvent) indexed on `at` alone, for the prune; their user index
dropped.

- `rate_windows_prune` deletes every key's calls older than two days. The one index on
  `at` started with (user, operation), so its batches went in id order: a walk of the
  primary key testing each row's `at` (the planner does not know ids grow with it, so
  with few old rows it sorted a sequential scan instead), and the batch that finds
  nothing, every run's last, read every call the table holds. (at) reads each batch, and
  the empty one, from the range alone.
- The user's own index (Django's for the foreign key) is a left prefix of
  (user, operation, at), which serves every lookup by user (the count's, ON DELETE
  CASCADE from auth_user): an insert pays for as many index entries as before.

Built and dropped CONCURRENTLY (hence `atomic = False`): every call under a limit of an
hour or more writes a row, and a plain CREATE or DROP INDEX would block those calls until
it had finished. The new index is built before the old one goes; both ways, lookups by
user always have an index."""

import django.db.models.deletion
from django.conf import settings
from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models

USER_INDEX = "memories_rateevent_user_id_91a3b14e"  # Django's name for it in memories 0007


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("memories", "0036_ingest_intent_open_created_drop_message_created_at"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        AddIndexConcurrently(model_name="rateevent", index=models.Index(fields=["at"], name="rate_event_at")),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="rateevent",
                    name="user",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="rate_events",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    f"DROP INDEX CONCURRENTLY IF EXISTS {USER_INDEX}",
                    reverse_sql=f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {USER_INDEX} ON memories_rateevent (user_id)",
                ),
            ],
        ),
    ]
