"""The append-only triggers check the conditions that make a delete or a redaction
legitimate, in the database, instead of trusting a session variable any role can set.

Before, `SET LOCAL memsite.audit_retention = 'on'` (or `memsite.history_redact`) let any
role with DELETE/UPDATE on the tables delete any audit row, delete any history row, or
blank the texts of a live memory's history; the real conditions lived only in Python.
Now the variables only say what the transaction means to do, and the triggers refuse:

- an audit row's delete unless the export watermark (the highest `last_id` of
  `audit_auditexportbatch`) covers it AND it is older than the retention floor
  (`memsite_audit_policy.retention_floor`, at least one day; a table only its owner
  role changes, whatever is granted, so an operator can raise it to the retention period);
- an audit row's insert at or below the watermark: an exported id is final, so an old
  row cannot be replaced under its id;
- any UPDATE or DELETE of an export batch (the watermark only moves forward), and a
  batch that does not start after the watermark or ends past the newest audit row;
- a history row's delete unless its memory no longer exists in the engine table and,
  when the row has an owner, that owner's audit data key is gone (an erasure destroys
  it first, in the same transaction);
- a history row's redaction (texts blanked, nothing else) while its memory still exists;
- a TRUNCATE by a role that is not (a member of) the table's owner, whatever the
  variable says (test isolation runs as the owner).

The functions pin their search_path (the migration's schema, then pg_temp), so that a
temporary table named like ours cannot stand in for the watermark or the engine table.
The engine table is the one this deployment's migrations created (MEMORY_COLLECTION at
migration time), as for the history owner trigger of 0013.
"""

from django.conf import settings
from django.db import migrations
from psycopg import sql

UUID_RE = "^[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}$"

POLICY = """
CREATE TABLE memsite_audit_policy (
  id boolean PRIMARY KEY DEFAULT true CHECK (id),
  retention_floor interval NOT NULL DEFAULT interval '1 day' CHECK (retention_floor >= interval '1 day')
);
INSERT INTO memsite_audit_policy DEFAULT VALUES;
-- Whatever is granted on it: only the owner role (migrations, an operator) changes it.
CREATE FUNCTION memsite_owner_only() RETURNS trigger AS $$
BEGIN
  IF pg_has_role(current_user, (SELECT c.relowner FROM pg_class c WHERE c.oid = TG_RELID), 'MEMBER') THEN
    RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
  END IF;
  RAISE EXCEPTION '% is changed by its owner only: % refused', TG_TABLE_NAME, TG_OP
    USING ERRCODE = 'insufficient_privilege';
END
$$ LANGUAGE plpgsql;
CREATE TRIGGER memsite_audit_policy_owner_only BEFORE INSERT OR UPDATE OR DELETE ON memsite_audit_policy
  FOR EACH ROW EXECUTE FUNCTION memsite_owner_only();
CREATE TRIGGER memsite_audit_policy_owner_truncates BEFORE TRUNCATE ON memsite_audit_policy
  FOR EACH STATEMENT EXECUTE FUNCTION memsite_owner_only();
CREATE FUNCTION memsite_audit_retention_floor() RETURNS interval AS $$
  SELECT greatest(coalesce((SELECT retention_floor FROM memsite_audit_policy), interval '1 day'), interval '1 day')
$$ LANGUAGE sql STABLE;
CREATE FUNCTION memsite_audit_watermark() RETURNS bigint AS $$
  SELECT coalesce(max(last_id), 0) FROM audit_auditexportbatch
$$ LANGUAGE sql STABLE;
"""
POLICY_DROP = """
DROP FUNCTION IF EXISTS memsite_audit_watermark();
DROP FUNCTION IF EXISTS memsite_audit_retention_floor();
DROP TABLE IF EXISTS memsite_audit_policy;
DROP FUNCTION IF EXISTS memsite_owner_only();
"""

# A memory exists while its engine row does (a trashed one too: the trash is a flag).
MEMORY_LIVE = """
CREATE FUNCTION memsite_memory_live(memory_id text) RETURNS boolean AS $$
BEGIN
  IF memory_id IS NULL OR memory_id !~ {uuid_re} THEN
    RETURN false;
  END IF;
  RETURN EXISTS (SELECT 1 FROM {table} m WHERE m.id = memory_id::uuid);
END
$$ LANGUAGE plpgsql STABLE;
"""
MEMORY_LIVE_DROP = "DROP FUNCTION IF EXISTS memsite_memory_live(text);"

# Shared by the audit rows (row and TRUNCATE triggers), the history's TRUNCATE trigger
# and the export batches.
APPEND_ONLY = """
CREATE OR REPLACE FUNCTION memsite_append_only() RETURNS trigger AS $$
DECLARE
  watermark bigint;
BEGIN
  IF TG_OP = 'DELETE' AND TG_TABLE_NAME = 'audit_auditevent'
     AND current_setting('memsite.audit_retention', true) = 'on' THEN
    watermark := memsite_audit_watermark();
    IF OLD.id > watermark THEN
      RAISE EXCEPTION 'audit_auditevent is append-only: row % is not exported yet (export watermark %)',
        OLD.id, watermark USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF OLD.occurred_at >= now() - memsite_audit_retention_floor() THEN
      RAISE EXCEPTION 'audit_auditevent is append-only: row % is younger than the retention floor (%)',
        OLD.id, memsite_audit_retention_floor() USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN OLD;
  END IF;
  -- Test isolation empties the tables as their owner; no one else, whatever the variable.
  IF TG_OP = 'TRUNCATE' AND current_setting('memsite.audit_allow_truncate', true) = 'on'
     AND pg_has_role(current_user, (SELECT c.relowner FROM pg_class c WHERE c.oid = TG_RELID), 'MEMBER') THEN
    RETURN NULL;
  END IF;
  RAISE EXCEPTION '% is append-only: % refused', TG_TABLE_NAME, TG_OP USING ERRCODE = 'insufficient_privilege';
END
$$ LANGUAGE plpgsql;
"""
APPEND_ONLY_BEFORE = """
CREATE OR REPLACE FUNCTION memsite_append_only() RETURNS trigger AS $$
BEGIN
  -- The retention job (and only it) sets memsite.audit_retention for its transaction.
  IF TG_OP = 'DELETE' AND current_setting('memsite.audit_retention', true) = 'on' THEN
    RETURN OLD;
  END IF;
  -- Test databases allow TRUNCATE so that test isolation can empty them.
  IF TG_OP = 'TRUNCATE' AND current_setting('memsite.audit_allow_truncate', true) = 'on' THEN
    RETURN NULL;
  END IF;
  RAISE EXCEPTION '% is append-only: % refused', TG_TABLE_NAME, TG_OP USING ERRCODE = 'insufficient_privilege';
END
$$ LANGUAGE plpgsql;
ALTER FUNCTION memsite_append_only() RESET search_path;
"""

AUDIT_INSERT = """
CREATE FUNCTION memsite_audit_insert() RETURNS trigger AS $$
BEGIN
  IF NEW.id <= memsite_audit_watermark() THEN
    RAISE EXCEPTION 'audit_auditevent is append-only: id % is already exported', NEW.id
      USING ERRCODE = 'insufficient_privilege';
  END IF;
  RETURN NEW;
END
$$ LANGUAGE plpgsql;
CREATE TRIGGER audit_auditevent_exported_ids BEFORE INSERT ON audit_auditevent
  FOR EACH ROW EXECUTE FUNCTION memsite_audit_insert();
"""
AUDIT_INSERT_DROP = """
DROP TRIGGER IF EXISTS audit_auditevent_exported_ids ON audit_auditevent;
DROP FUNCTION IF EXISTS memsite_audit_insert();
"""

EXPORT_BATCH = """
CREATE FUNCTION memsite_export_batch_insert() RETURNS trigger AS $$
DECLARE
  watermark bigint := memsite_audit_watermark();
BEGIN
  IF NEW.first_id <= watermark OR NEW.last_id < NEW.first_id
     OR NEW.last_id > coalesce((SELECT max(e.id) FROM audit_auditevent e), 0) THEN
    RAISE EXCEPTION 'audit_auditexportbatch: ids % to % do not follow the watermark (%) up to a recorded audit row',
      NEW.first_id, NEW.last_id, watermark USING ERRCODE = 'check_violation';
  END IF;
  -- When the watermark moved is the database's word, not the writer's.
  NEW.exported_at := now();
  RETURN NEW;
END
$$ LANGUAGE plpgsql;
CREATE TRIGGER audit_auditexportbatch_follows BEFORE INSERT ON audit_auditexportbatch
  FOR EACH ROW EXECUTE FUNCTION memsite_export_batch_insert();
CREATE TRIGGER audit_auditexportbatch_append_only BEFORE UPDATE OR DELETE ON audit_auditexportbatch
  FOR EACH ROW EXECUTE FUNCTION memsite_append_only();
CREATE TRIGGER audit_auditexportbatch_no_truncate BEFORE TRUNCATE ON audit_auditexportbatch
  FOR EACH STATEMENT EXECUTE FUNCTION memsite_append_only();
"""
EXPORT_BATCH_DROP = """
DROP TRIGGER IF EXISTS audit_auditexportbatch_no_truncate ON audit_auditexportbatch;
DROP TRIGGER IF EXISTS audit_auditexportbatch_append_only ON audit_auditexportbatch;
DROP TRIGGER IF EXISTS audit_auditexportbatch_follows ON audit_auditexportbatch;
DROP FUNCTION IF EXISTS memsite_export_batch_insert();
"""

HISTORY_APPEND_ONLY = """
CREATE OR REPLACE FUNCTION memsite_history_append_only() RETURNS trigger AS $$
DECLARE
  owner_pk text;
BEGIN
  -- A purge sets memsite.history_redact: it may blank the texts, nothing else, of a
  -- memory that no longer exists.
  IF TG_OP = 'UPDATE' AND current_setting('memsite.history_redact', true) = 'on'
     AND NEW.old_memory IS NULL AND NEW.new_memory IS NULL
     AND to_jsonb(NEW) - 'old_memory' - 'new_memory' = to_jsonb(OLD) - 'old_memory' - 'new_memory' THEN
    IF memsite_memory_live(OLD.memory_id) THEN
      RAISE EXCEPTION 'audit_memoryhistory is append-only: memory % still exists, its texts stay', OLD.memory_id
        USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NEW;
  END IF;
  -- An erasure sets memsite.audit_retention: it may delete the versions of memories
  -- that no longer exist, of an owner whose audit data key it has destroyed.
  IF TG_OP = 'DELETE' AND current_setting('memsite.audit_retention', true) = 'on' THEN
    IF memsite_memory_live(OLD.memory_id) THEN
      RAISE EXCEPTION 'audit_memoryhistory is append-only: memory % still exists, its history stays', OLD.memory_id
        USING ERRCODE = 'insufficient_privilege';
    END IF;
    owner_pk := substring(OLD.engine_user_id FROM ':([0-9]{1,18})$');
    IF OLD.engine_user_id <> '' AND (owner_pk IS NULL OR EXISTS (
         SELECT 1 FROM audit_subjectkey k WHERE k.subject_user_id = owner_pk::bigint)) THEN
      RAISE EXCEPTION 'audit_memoryhistory is append-only: the owner of memory % is not erased', OLD.memory_id
        USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN OLD;
  END IF;
  RAISE EXCEPTION '% is append-only: % refused', TG_TABLE_NAME, TG_OP USING ERRCODE = 'insufficient_privilege';
END
$$ LANGUAGE plpgsql;
"""
HISTORY_APPEND_ONLY_BEFORE = """
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
ALTER FUNCTION memsite_history_append_only() RESET search_path;
ALTER FUNCTION memsite_history_owner() RESET search_path;
"""

# Every function a trigger runs, pinned to this schema (pg_temp last, where it cannot
# shadow our tables).
PINNED = (
    "memsite_owner_only()",
    "memsite_audit_retention_floor()",
    "memsite_audit_watermark()",
    "memsite_memory_live(text)",
    "memsite_append_only()",
    "memsite_audit_insert()",
    "memsite_export_batch_insert()",
    "memsite_history_append_only()",
    "memsite_history_owner()",
)


def _engine_table(schema_editor) -> str:
    return sql.Identifier(settings.MEMORY_COLLECTION).as_string(schema_editor.connection.connection)


def memory_live(apps, schema_editor):
    schema_editor.execute(
        MEMORY_LIVE.replace("{uuid_re}", f"'{UUID_RE}'").replace("{table}", _engine_table(schema_editor))
    )


def memory_live_drop(apps, schema_editor):
    schema_editor.execute(MEMORY_LIVE_DROP)


def pin_search_path(apps, schema_editor):
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT current_schema()")
        schema = sql.Identifier(cursor.fetchone()[0]).as_string(schema_editor.connection.connection)
    for function in PINNED:
        schema_editor.execute(f"ALTER FUNCTION {function} SET search_path = {schema}, pg_temp")


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0020_login_failures"),
        # The engine's table (id), which memsite_memory_live reads; its first migration
        # only, as 0013.
        ("memories", "0002_vector_tables"),
    ]

    operations = [
        migrations.RunSQL(POLICY, POLICY_DROP),
        migrations.RunPython(memory_live, memory_live_drop),
        migrations.RunSQL(APPEND_ONLY, APPEND_ONLY_BEFORE),
        migrations.RunSQL(AUDIT_INSERT, AUDIT_INSERT_DROP),
        migrations.RunSQL(EXPORT_BATCH, EXPORT_BATCH_DROP),
        migrations.RunSQL(HISTORY_APPEND_ONLY, HISTORY_APPEND_ONLY_BEFORE),
        migrations.RunPython(pin_search_path, migrations.RunPython.noop),
    ]
