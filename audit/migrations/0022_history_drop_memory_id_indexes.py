"""Memory history drops its one-column memory_id indexes: the btree Django's `db_index`
made and its varchar_pattern_ops twin (for LIKE, which nothing runs on memory ids). Every
lookup by memory id (a memory's versions, exports, maintenance, the owner trigger, purge
and erasure) reads the (memory_id, recorded_at) index, whose leading column they
duplicated; each history write paid for two more index entries.

Dropped CONCURRENTLY (hence `atomic = False`), one statement each: the history table
takes a row per memory change, and a plain DROP INDEX would block its writes and reads
until it had its lock. The names are those Django gave them in audit 0001."""

from django.db import migrations, models

INDEXES = {
    "audit_memoryhistory_memory_id_46e08653": "(memory_id)",
    "audit_memoryhistory_memory_id_46e08653_like": "(memory_id varchar_pattern_ops)",
}


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("audit", "0021_append_only_conditions"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="memoryhistory", name="memory_id", field=models.CharField(max_length=64)
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    f"DROP INDEX CONCURRENTLY IF EXISTS {name}",
                    reverse_sql=f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON audit_memoryhistory {columns}",
                )
                for name, columns in INDEXES.items()
            ],
        ),
    ]
