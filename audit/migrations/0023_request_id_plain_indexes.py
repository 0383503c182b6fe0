"""Audit rows and memory history keep one plain index on request_id each, without the
varchar_pattern_ops twin Django's `db_index` built beside it in audit 0001. That twin
serves only LIKE 'prefix%' under a non-C collation, and nothing searches request ids by
prefix (every lookup is exact: the admin's searches, a turn's lifecycle, erasure, ingest's
reconcile); every audited call and every memory change paid an index entry for it.

The plain index stays, renamed to the name its Meta.indexes entry gives it (a rename is a
catalog change, under a lock that blocks neither reads nor writes since PostgreSQL 12); it
is built only if a database lacks it. The twin is dropped CONCURRENTLY (hence
`atomic = False`), one statement each: both tables take a row per call, and a plain DROP
INDEX would block their writes and reads until it had its lock."""

from django.db import migrations, models

# (model, table, the name Django gave the index in audit 0001, its Meta name)
INDEXES = [
    ("auditevent", "audit_auditevent", "audit_auditevent_request_id_b6fdcfa6", "audit_request"),
    ("memoryhistory", "audit_memoryhistory", "audit_memoryhistory_request_id_f24d624c", "history_request"),
]


def _database_operations(table: str, old: str, new: str) -> list[migrations.RunSQL]:
    return [
        migrations.RunSQL(
            f"DROP INDEX CONCURRENTLY IF EXISTS {old}_like",
            reverse_sql=f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {old}_like ON {table} (request_id varchar_pattern_ops)",
        ),
        migrations.RunSQL(
            f"ALTER INDEX IF EXISTS {old} RENAME TO {new}",
            reverse_sql=f"ALTER INDEX IF EXISTS {new} RENAME TO {old}",
        ),
        migrations.RunSQL(
            f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {new} ON {table} (request_id)",
            reverse_sql=migrations.RunSQL.noop,
        ),
    ]


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("audit", "0022_history_drop_memory_id_indexes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="auditevent", name="request_id", field=models.CharField(max_length=64)
                ),
                migrations.AlterField(
                    model_name="memoryhistory", name="request_id", field=models.CharField(blank=True, max_length=64)
                ),
                *(
                    migrations.AddIndex(model_name=model, index=models.Index(fields=["request_id"], name=new))
                    for model, _, _, new in INDEXES
                ),
            ],
            database_operations=[
                operation for _, table, old, new in INDEXES for operation in _database_operations(table, old, new)
            ],
        ),
    ]
