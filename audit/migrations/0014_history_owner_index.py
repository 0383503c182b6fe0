"""The index a user's erasure deletes their memory history by (`engine_user_id`).

Built CONCURRENTLY: the history table grows with every memory change, and a plain
CREATE INDEX would block every write while it builds (hence `atomic = False`)."""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("audit", "0013_history_owner"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="memoryhistory",
            index=models.Index(condition=~models.Q(engine_user_id=""), fields=["engine_user_id"], name="history_owner"),
        ),
    ]
