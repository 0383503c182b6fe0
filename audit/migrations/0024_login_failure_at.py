"""Failed sign-ins (LoginFailure) indexed on `at` alone, for the prune.

`login_failures_prune` deletes every key's failures out of the throttle's window. The one
index on `at` started with the key (a username digest or a client address, nearly one
per row under a spread-out attack), so its batches went in id order: a walk of the
primary key testing each row's `at`, or, as the planner does not know ids grow with it,
a sequential scan sorted by id; and the batch that finds nothing, every run's last, read
every failure in the window. (at) reads each batch, and the empty one, from the range
alone. The throttle's own reads stay on (key, at).

Built CONCURRENTLY (hence `atomic = False`): every password sign-in writes rows here,
and a plain CREATE INDEX would block sign-ins until it had finished."""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("audit", "0023_request_id_plain_indexes"),
    ]

    operations = [
        AddIndexConcurrently(model_name="loginfailure", index=models.Index(fields=["at"], name="login_failure_at")),
    ]
