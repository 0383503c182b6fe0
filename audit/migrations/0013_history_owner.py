"""Memory history gets its owner (`engine_user_id`), so that erasing a user deletes every
version of their memories by owner: also of memories hard-deleted long ago (a purge, the
ingest dedupe rule) whose audit rows retention has removed, and never another user's
(failed calls' audit rows can name anyone's ids).

- A BEFORE INSERT trigger fills the owner of every new row, whoever writes it (mem0's own
  writes through the history store, the trash's SQL, imports): from the engine row of
  the memory, else (the row is already gone: a DELETE) from the memory's earlier
  versions. The engine table is the one this deployment's migrations created
  (MEMORY_COLLECTION at migration time, as for the vector tables themselves).
- The append-only trigger of the history table also lets a purge blank the two text
  columns (and nothing else) when it sets `memsite.history_redact` for its transaction:
  "delete forever" keeps the record of what happened, not what the memory said.
- Existing rows are attributed from the engine rows, then from the audit trail's
  successful calls where exactly one user's calls name the id; the rest stay "" and a
  wipe still finds them through its user's successful audit rows.
"""

from django.conf import settings
from django.db import migrations, models
from psycopg import sql

UUID_RE = "^[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}$"

OWNER_FUNCTION = """
CREATE OR REPLACE FUNCTION memsite_history_owner() RETURNS trigger AS $$
BEGIN
  IF coalesce(NEW.engine_user_id, '') = '' THEN
    IF NEW.memory_id ~ {uuid_re} THEN
      SELECT m.payload->>'user_id' INTO NEW.engine_user_id FROM {table} m WHERE m.id = NEW.memory_id::uuid;
    END IF;
    IF coalesce(NEW.engine_user_id, '') = '' THEN
      SELECT h.engine_user_id INTO NEW.engine_user_id FROM audit_memoryhistory h
       WHERE h.memory_id = NEW.memory_id AND h.engine_user_id <> '' ORDER BY h.recorded_at DESC LIMIT 1;
    END IF;
    NEW.engine_user_id := coalesce(NEW.engine_user_id, '');
  END IF;
  RETURN NEW;
END
$$ LANGUAGE plpgsql;
CREATE TRIGGER audit_memoryhistory_owner BEFORE INSERT ON audit_memoryhistory
  FOR EACH ROW EXECUTE FUNCTION memsite_history_owner();
"""
OWNER_DROP = """
DROP TRIGGER IF EXISTS audit_memoryhistory_owner ON audit_memoryhistory;
DROP FUNCTION IF EXISTS memsite_history_owner();
"""

HISTORY_APPEND_ONLY = """
CREATE OR REPLACE FUNCTION memsite_history_append_only() RETURNS trigger AS $$
BEGIN
  -- A purge (and only it) sets memsite.history_redact: it may blank the texts, nothing else.
  IF TG_OP = 'UPDATE' AND current_setting('memsite.history_redact', true) = 'on'
     AND NEW.old_memory IS NULL AND NEW.new_memory IS NULL
     AND to_jsonb(NEW) - 'old_memory' - 'new_memory' = to_jsonb(OLD) - 'old_memory' - 'new_memory' THEN
    RETURN NEW;
  END IF;
  IF TG_OP = 'DELETE' AND current_setting('memsite.audit_retention', true) = 'on' THEN
    RETURN OLD;
  END IF;
  RAISE EXCEPTION '% is append-only: % refused', TG_TABLE_NAME, TG_OP USING ERRCODE = 'insufficient_privilege';
END
$$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS audit_memoryhistory_append_only ON audit_memoryhistory;
CREATE TRIGGER audit_memoryhistory_append_only BEFORE UPDATE OR DELETE ON audit_memoryhistory
  FOR EACH ROW EXECUTE FUNCTION memsite_history_append_only();
"""
HISTORY_APPEND_ONLY_DROP = """
DROP TRIGGER IF EXISTS audit_memoryhistory_append_only ON audit_memoryhistory;
CREATE TRIGGER audit_memoryhistory_append_only BEFORE UPDATE OR DELETE ON audit_memoryhistory
  FOR EACH ROW EXECUTE FUNCTION memsite_append_only();
DROP FUNCTION IF EXISTS memsite_history_append_only();
"""

BACKFILL_FROM_ENGINE = """
UPDATE audit_memoryhistory h SET engine_user_id = m.payload->>'user_id'
  FROM {table} m WHERE h.engine_user_id = '' AND h.memory_id = m.id::text AND m.payload->>'user_id' <> ''
"""
# Only successful calls (a failed or denied call records whatever id it was given), and
# only ids that one user's calls name (never guess between two).
BACKFILL_FROM_AUDIT = """
WITH named AS (
  SELECT DISTINCT ids.id AS memory_id, e.tenant || ':' || e.subject_user_id::text AS owner
    FROM audit_auditevent e, jsonb_array_elements_text(e.memory_ids) AS ids(id)
   WHERE e.outcome = 'ok' AND e.subject_user_id IS NOT NULL AND e.tenant <> ''
), single AS (
  SELECT memory_id, min(owner) AS owner FROM named GROUP BY memory_id HAVING count(*) = 1
)
UPDATE audit_memoryhistory h SET engine_user_id = s.owner
  FROM single s WHERE h.engine_user_id = '' AND h.memory_id = s.memory_id
"""


def _engine_table(schema_editor) -> str:
    return sql.Identifier(settings.MEMORY_COLLECTION).as_string(schema_editor.connection.connection)


def owner_trigger(apps, schema_editor):
    schema_editor.execute(
        OWNER_FUNCTION.replace("{uuid_re}", f"'{UUID_RE}'").replace("{table}", _engine_table(schema_editor))
    )


def owner_trigger_drop(apps, schema_editor):
    schema_editor.execute(OWNER_DROP)


def backfill(apps, schema_editor):
    # The history table is append-only by trigger; this migration alone lifts it, inside
    # its transaction (as 0010 does for the audit rows).
    schema_editor.execute("ALTER TABLE audit_memoryhistory DISABLE TRIGGER audit_memoryhistory_append_only")
    schema_editor.execute(BACKFILL_FROM_ENGINE.replace("{table}", _engine_table(schema_editor)))
    schema_editor.execute(BACKFILL_FROM_AUDIT)
    schema_editor.execute("ALTER TABLE audit_memoryhistory ENABLE TRIGGER audit_memoryhistory_append_only")


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0012_admin_search_indexes"),
        # The engine's table (id, payload), which the owner trigger and the backfill read.
        # Its first migration only: a later one would tie this column to the memories
        # app's state (migrating memories back would remove it under running code).
        ("memories", "0002_vector_tables"),
    ]

    operations = [
        migrations.AddField(
            model_name="memoryhistory",
            name="engine_user_id",
            field=models.CharField(blank=True, db_default="", max_length=255),
        ),
        migrations.RunPython(owner_trigger, owner_trigger_drop),
        migrations.RunSQL(HISTORY_APPEND_ONLY, HISTORY_APPEND_ONLY_DROP),
        migrations.RunPython(backfill, migrations.RunPython.noop),
    ]
