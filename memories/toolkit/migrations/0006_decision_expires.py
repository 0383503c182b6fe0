"""Decisions indexed on `expires_at`, over the ones that expire, for the purge.

`toolkit_expired_purge` (every 10 minutes) deletes every user's expired decisions: with
no index on `expires_at` each run read the whole table, up to DECISION_MAX_PER_USER rows
per user, to find the few that expired since the last run. The index is partial on
`expires_at IS NOT NULL` (implied by the purge's `expires_at <= now`): a decision stored
without ttl_days never expires and costs nothing here. A store at the cap that deletes
the user's expired decisions may read it too, though (user, key) bounds that read to the
user's rows already.

Built CONCURRENTLY (hence `atomic = False`), so that stores are not blocked meanwhile."""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("toolkit", "0005_drop_user_prefix_indexes"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="decision",
            index=models.Index(
                fields=["expires_at"], condition=models.Q(expires_at__isnull=False), name="decision_expires"
            ),
        ),
    ]
