"""The admin's "failed" filter, newest first, through an index of the failed rows only.

Built CONCURRENTLY: the outbox gains a row per billed call, and a plain CREATE INDEX would
block every billed call while it builds. Concurrent builds cannot run in a transaction,
hence `atomic = False`.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("billing", "0001_initial"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="usageevent",
            index=models.Index(condition=models.Q(status="failed"), fields=["-created_at"], name="usage_event_failed"),
        ),
    ]
