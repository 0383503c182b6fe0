"""Ingest intents (a row per ingest call) and mem0's raw messages (rows per ingest, kept
per session) lose the varchar_pattern_ops twins Django's `unique=True`/`db_index` built
beside their id indexes in memories 0001 and 0006. A twin serves only LIKE 'prefix%'
under a non-C collation, and nothing matches these columns by prefix: the proxy looks its
attempts' intents up by exact request ids, mem0 reads and trims a session's messages by
its exact scope, and the purges delete a user's messages by exact user id. Neither table
is in the admin. Every ingest paid entries in them.

The plain indexes stay, renamed to the names their Meta entries give them (a rename is a
catalog change, under a lock that blocks neither reads nor writes since PostgreSQL 12); a
raw-message index is built only if a database lacks it. The intents' uniqueness moves to
Meta.constraints; renaming its index renames the constraint with it. The twins are
dropped CONCURRENTLY (hence `atomic = False`), one statement each: a plain DROP INDEX
would block the tables' writes and reads until it had its lock."""

from django.db import migrations, models

MESSAGES = "memories_enginemessage"
INTENTS = "memories_ingestintent"
# (column, the name Django gave its index in memories 0001, its Meta name)
MESSAGE_INDEXES = [
    ("session_scope", "memories_enginemessage_session_scope_9e490e1a", "engine_message_scope"),
    ("user_id", "memories_enginemessage_user_id_516c23fd", "engine_message_user"),
]
INTENT_LIKE = "memories_ingestintent_request_id_ad931178_like"  # memories 0006
INTENT_KEY = "memories_ingestintent_request_id_key"  # the UNIQUE PostgreSQL named in memories 0006
INTENT_UNIQUE = "ingest_intent_request_unique"


def _drop_like(table: str, column: str, like: str) -> migrations.RunSQL:
    return migrations.RunSQL(
        f"DROP INDEX CONCURRENTLY IF EXISTS {like}",
        reverse_sql=f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {like} ON {table} ({column} varchar_pattern_ops)",
    )


def _rename(old: str, new: str) -> migrations.RunSQL:
    return migrations.RunSQL(
        f"ALTER INDEX IF EXISTS {old} RENAME TO {new}", reverse_sql=f"ALTER INDEX IF EXISTS {new} RENAME TO {old}"
    )


def _message_operations(column: str, old: str, new: str) -> list[migrations.RunSQL]:
    return [
        _drop_like(MESSAGES, column, f"{old}_like"),
        _rename(old, new),
        migrations.RunSQL(
            f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {new} ON {MESSAGES} ({column})",
            reverse_sql=migrations.RunSQL.noop,
        ),
    ]


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("memories", "0031_drop_user_prefix_indexes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="enginemessage", name="session_scope", field=models.CharField(max_length=512)
                ),
                migrations.AlterField(
                    model_name="enginemessage", name="user_id", field=models.CharField(blank=True, max_length=255)
                ),
                *(
                    migrations.AddIndex(model_name="enginemessage", index=models.Index(fields=[column], name=new))
                    for column, _, new in MESSAGE_INDEXES
                ),
                migrations.AlterField(
                    model_name="ingestintent", name="request_id", field=models.CharField(max_length=64)
                ),
                migrations.AddConstraint(
                    model_name="ingestintent",
                    constraint=models.UniqueConstraint(fields=["request_id"], name=INTENT_UNIQUE),
                ),
            ],
            database_operations=[
                *(operation for index in MESSAGE_INDEXES for operation in _message_operations(*index)),
                _drop_like(INTENTS, "request_id", INTENT_LIKE),
                _rename(INTENT_KEY, INTENT_UNIQUE),
            ],
        ),
    ]
