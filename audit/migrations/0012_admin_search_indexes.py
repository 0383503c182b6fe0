"""Indexes for the audit page's search by user id or username and its actor/staff links.

Built CONCURRENTLY: the audit table is the largest one a deployment has (a row per call),
and a plain CREATE INDEX would block every audited call while it builds. Concurrent
builds cannot run in a transaction, hence `atomic = False`.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("audit", "0011_seal_existing_details"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="auditevent",
            index=models.Index(
                condition=~models.Q(actor_user_id=models.F("subject_user_id")),
                fields=["actor_user_id", "-id"],
                name="audit_actor_recent",
            ),
        ),
        AddIndexConcurrently(
            model_name="auditevent",
            index=models.Index(fields=["actor_username", "-id"], name="audit_actor_name_recent"),
        ),
        AddIndexConcurrently(
            model_name="auditevent",
            index=models.Index(
                condition=models.Q(staff_user_id__isnull=False),
                fields=["staff_user_id", "-id"],
                name="audit_staff_recent",
            ),
        ),
        AddIndexConcurrently(
            model_name="auditevent",
            index=models.Index(
                condition=~models.Q(staff_username=""),
                fields=["staff_username", "-id"],
                name="audit_staff_name_recent",
            ),
        ),
    ]
