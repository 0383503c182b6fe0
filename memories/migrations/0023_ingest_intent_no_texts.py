"""Closed ingest intents no longer keep the ingested texts (only ids and events): strip
them from the intents closed before. The texts are the user's content; an intent is a
record that a call ran, and it outlives the memories (and, before this, their erasure)."""

from django.db import migrations

STRIP = """
UPDATE memories_ingestintent
   SET results = (SELECT coalesce(jsonb_agg(r - 'memory'), '[]'::jsonb) FROM jsonb_array_elements(results) AS r)
 WHERE state <> 'open' AND jsonb_typeof(results) = 'array' AND results::text LIKE '%"memory"%'
"""


class Migration(migrations.Migration):
    dependencies = [
        ("memories", "0022_drop_lemmas_index"),
    ]

    # Not reversible into the texts: they are gone, which is the point.
    operations = [migrations.RunSQL(STRIP, migrations.RunSQL.noop)]
