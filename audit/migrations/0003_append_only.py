from django.db import migrations

TABLES = ("audit_auditevent", "audit_memoryhistory")

FUNCTION = """
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
"""


def _triggers(table: str) -> str:
    return f"""
CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table}
  FOR EACH ROW EXECUTE FUNCTION memsite_append_only();
CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table}
  FOR EACH STATEMENT EXECUTE FUNCTION memsite_append_only();
"""


def _drop(table: str) -> str:
    return (
        f"DROP TRIGGER IF EXISTS {table}_append_only ON {table}; DROP TRIGGER IF EXISTS {table}_no_truncate ON {table};"
    )


class Migration(migrations.Migration):
    dependencies = [("audit", "0002_audit_events")]

    operations = [
        migrations.RunSQL(FUNCTION, "DROP FUNCTION IF EXISTS memsite_append_only() CASCADE"),
        *[migrations.RunSQL(_triggers(t), _drop(t)) for t in TABLES],
    ]
