"""A user's usage events are indexed on (user_id, created_at) instead of (user_id) alone.
Their usage page asks for the last 30 days and the admin's search by user id for the
newest first (or a date range): with user_id alone each read every event the user ever
had, one per billed call since they signed up, to keep the recent ones. The composite
index answers the range (and the order) from the index and serves every lookup by user
id the old one did; it replaces it, so an insert still pays for one index entry.

The new index is built CONCURRENTLY before the old one is dropped CONCURRENTLY (hence
`atomic = False`), one statement each: the outbox takes a row per billed call, and a
plain CREATE or DROP INDEX would block its writes until done. Lookups by user id have an
index at every step, both ways."""

from django.db import migrations, models

OLD = "usage_event_user"  # billing 0004
NEW = "usage_event_user_created"


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("billing", "0004_user_id_plain_index"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="usageevent", index=models.Index(fields=["user_id", "created_at"], name=NEW)
                ),
                migrations.RemoveIndex(model_name="usageevent", name=OLD),
            ],
            database_operations=[
                migrations.RunSQL(
                    f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {NEW} ON billing_usageevent (user_id, created_at)",
                    reverse_sql=f"DROP INDEX CONCURRENTLY IF EXISTS {NEW}",
                ),
                migrations.RunSQL(
                    f"DROP INDEX CONCURRENTLY IF EXISTS {OLD}",
                    reverse_sql=f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {OLD} ON billing_usageevent (user_id)",
                ),
            ],
        ),
    ]
