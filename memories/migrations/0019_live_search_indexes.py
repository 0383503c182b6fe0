"""Search's HNSW and full-text indexes over live rows only, and an owner index of live rows
(vector_schema.create_live_search_indexes): trashed memories no longer slow searches."""

import logging

from django.conf import settings
from django.db import migrations

from memories.engine.vector_schema import create_live_search_indexes, drop_live_search_indexes

logger = logging.getLogger(__name__)

# Measured on two cores: 150,000 rows took 13 s; a million rows takes minutes.
ANNOUNCE_FROM_ROWS = 50_000


def _announce(schema_editor) -> None:
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass(%s)", [settings.MEMORY_COLLECTION]
        )
        row = cursor.fetchone()
    rows = int(row[0]) if row else 0
    if rows >= ANNOUNCE_FROM_ROWS:
        logger.warning("rebuilding the search indexes over about %d memories: this can take minutes", rows)


def forwards(apps, schema_editor):
    _announce(schema_editor)
    create_live_search_indexes(schema_editor)


def backwards(apps, schema_editor):
    _announce(schema_editor)
    drop_live_search_indexes(schema_editor)


class Migration(migrations.Migration):
    dependencies = [("memories", "0018_vacuum_sooner")]

    operations = [migrations.RunPython(forwards, backwards)]
