"""The admin's rate windows page, newest first, unfiltered or by operation, without sorting
the windows per page: every fixed window of a minute starts at the same instant, so the
one-column window_start index left every active user's windows of the latest minute to
sort. The new (window_start, id) index serves the prune's range as the old one did, so
that one is dropped.

Built and dropped CONCURRENTLY: a window row is written by every rate-limited call, and a
plain CREATE or DROP INDEX would block those writes while it runs (hence `atomic = False`)."""

from django.contrib.postgres.operations import AddIndexConcurrently, RemoveIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("memories", "0029_session_state_recent"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="ratewindow",
            index=models.Index(fields=["-window_start", "-id"], name="rate_window_recent"),
        ),
        AddIndexConcurrently(
            model_name="ratewindow",
            index=models.Index(fields=["operation", "-window_start", "-id"], name="rate_window_operation_recent"),
        ),
        RemoveIndexConcurrently(model_name="ratewindow", name="memories_ra_window__31674c_idx"),
    ]
