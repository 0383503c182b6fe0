from django.apps import AppConfig


def steady_pool_reconnects() -> None:
    """psycopg_pool (pinned 3.3.3) retries a failed connect after 1 s, 2 s, 4 s, 8 s, ...:
    after a 3-second database restart a process would wait up to 4 more seconds, and requests
    already waiting for a connection time out meanwhile. Retry every ~1 s instead (for the
    pools' reconnect_timeout, settings.DATABASE_POOL_RECONNECT_TIMEOUT_S), so every pool in
    every process is back within about a second of the database. A class constant, hence set
    here, once per process, for Django's pool and mem0's alike."""
    from psycopg_pool.base import AttemptWithBackoff

    AttemptWithBackoff.DELAY_BACKOFF = 1.0


class MemsiteConfig(AppConfig):
    name = "memsite"
    verbose_name = "Service"

    def ready(self) -> None:
        steady_pool_reconnects()
        # uvicorn configured its own handlers before importing us: filter them too.
        from core.log_safety import install_content_filter

        install_content_filter()
        from memories.sessions import erasure_account_deleted_register, erasure_register
        from memsite.services import erasure_ledger_account_deleted, erasure_ledger_record

        # Every erasure leaves a record next to the backups (the erasure ledger), added in
        # the erasure's own transaction, so that a restore to a point before it does it again
        # (and deletes the account again when the erasure deleted it).
        erasure_register(erasure_ledger_record)
        erasure_account_deleted_register(erasure_ledger_account_deleted)
        from memsite import checks  # noqa: F401 - registers the settings checks
