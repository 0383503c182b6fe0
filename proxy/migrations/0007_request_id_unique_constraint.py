"""Chat turns keep request_id unique without the varchar_pattern_ops index Django's
`unique=True` built beside the UNIQUE in proxy 0001. That index serves only LIKE 'prefix%'
under a non-C collation, and nothing searches turns by request id prefix; every proxied
chat call paid an index entry for it.

The uniqueness moves to Meta.constraints under the name PostgreSQL gave the column's
UNIQUE, so the database keeps its constraint and index as they are. The pattern index is
dropped CONCURRENTLY (hence `atomic = False`): the table takes a row per chat call, and a
plain DROP INDEX would block its writes and reads until it had its lock."""

from django.db import migrations, models

LIKE = "proxy_proxyturn_request_id_e191a71a_like"  # the name Django gave it in proxy 0001


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("proxy", "0006_turn_recent_index"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(model_name="proxyturn", name="request_id", field=models.CharField(max_length=64)),
                migrations.AddConstraint(
                    model_name="proxyturn",
                    constraint=models.UniqueConstraint(fields=["request_id"], name="proxy_proxyturn_request_id_key"),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    f"DROP INDEX CONCURRENTLY IF EXISTS {LIKE}",
                    reverse_sql=f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {LIKE}"
                    " ON proxy_proxyturn (request_id varchar_pattern_ops)",
                ),
            ],
        ),
    ]
