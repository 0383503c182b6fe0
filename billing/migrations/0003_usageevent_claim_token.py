"""A per-claim token on usage events: settling matches it, so a worker whose lease ran out
cannot overwrite the outcome of the worker that claimed the events after it.

A nullable column without a default: PostgreSQL adds it to the catalog only (no table
rewrite, a brief ACCESS EXCLUSIVE lock), so the outbox keeps taking billed calls.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0002_failed_events_index"),
    ]

    operations = [
        migrations.AddField(
            model_name="usageevent",
            name="claim_token",
            field=models.UUIDField(blank=True, editable=False, null=True),
        ),
    ]
