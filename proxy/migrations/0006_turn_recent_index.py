"""The admin's chat turn page, newest first, without sorting every turn per page (the
due index leads with the state, so it serves only the state filter).

Built CONCURRENTLY: the table gains a row per proxied chat call, and a plain CREATE INDEX
would block every one of them while it builds (hence `atomic = False`)."""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("proxy", "0005_turn_retry_backoff"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="proxyturn",
            index=models.Index(fields=["-created_at", "-id"], name="proxy_turn_recent"),
        ),
    ]
