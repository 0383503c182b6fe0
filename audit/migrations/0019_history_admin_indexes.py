"""The admin's memory history page, newest first, unfiltered or by event, without sorting
the whole history per page.

Built CONCURRENTLY: the history table grows with every memory change, and a plain
CREATE INDEX would block every write while it builds (hence `atomic = False`)."""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("audit", "0018_credential_index"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="memoryhistory",
            index=models.Index(fields=["-recorded_at", "-id"], name="history_recent"),
        ),
        AddIndexConcurrently(
            model_name="memoryhistory",
            index=models.Index(fields=["event", "-recorded_at", "-id"], name="history_event_recent"),
        ),
    ]
