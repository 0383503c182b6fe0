"""The admin's search by credential (`key:<key id>`, `oidc:<client>`): one credential's
calls, newest first, without reading the whole audit table. Built CONCURRENTLY, like
0012, so audited calls are not blocked while it builds."""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("audit", "0017_actor_credential"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="auditevent",
            index=models.Index(
                condition=~models.Q(actor_credential=""),
                fields=["actor_credential", "-id"],
                name="audit_credential_recent",
            ),
        ),
    ]
