"""The erasure ledger searched by user id or request id (the admin's search; a deleted
account's pending rows) through an index: the ledger keeps a row per erasure for good.

Built CONCURRENTLY (hence `atomic = False`): an erasure writes its row while it runs."""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("memsite", "0003_erasure_ledger_account_deleted"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="erasureledger",
            index=models.Index(fields=["user_pk"], name="erasure_ledger_user"),
        ),
        AddIndexConcurrently(
            model_name="erasureledger",
            index=models.Index(fields=["request_id"], name="erasure_ledger_request"),
        ),
    ]
