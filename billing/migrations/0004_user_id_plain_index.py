"""Usage events keep one plain index on user_id, without the varchar_pattern_ops twin
Django's `db_index` built beside it in billing 0001. That twin serves only LIKE 'prefix%'
under a non-C collation, and nothing searches user ids by prefix (a user's usage page and
the admin's search are exact); every billed call paid an index entry for it.

The plain index stays, renamed to the name its Meta.indexes entry gives it (a rename is a
catalog change, under a lock that blocks neither reads nor writes since PostgreSQL 12); it
is built only if a database lacks it. The twin is dropped CONCURRENTLY (hence
`atomic = False`), one statement each: the outbox takes a row per billed call, and a
plain DROP INDEX would block its writes and reads until it had its lock."""

from django.db import migrations, models

OLD = "billing_usageevent_user_id_45fe71e5"  # the name Django gave it in billing 0001
NEW = "usage_event_user"


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("billing", "0003_usageevent_claim_token"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(model_name="usageevent", name="user_id", field=models.CharField(max_length=64)),
                migrations.AddIndex(model_name="usageevent", index=models.Index(fields=["user_id"], name=NEW)),
            ],
            database_operations=[
                migrations.RunSQL(
                    f"DROP INDEX CONCURRENTLY IF EXISTS {OLD}_like",
                    reverse_sql=f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {OLD}_like"
                    " ON billing_usageevent (user_id varchar_pattern_ops)",
                ),
                migrations.RunSQL(
                    f"ALTER INDEX IF EXISTS {OLD} RENAME TO {NEW}",
                    reverse_sql=f"ALTER INDEX IF EXISTS {NEW} RENAME TO {OLD}",
                ),
                migrations.RunSQL(
                    f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {NEW} ON billing_usageevent (user_id)",
                    reverse_sql=migrations.RunSQL.noop,
                ),
            ],
        ),
    ]
