"""S3-compatible storage (R2, S3, MinIO) that puts every object under object lock."""

from datetime import UTC, datetime, timedelta

from storages.backends.s3 import S3Storage


class LockedS3Storage(S3Storage):
    def __init__(self, *, object_lock_mode: str | None = "COMPLIANCE", object_lock_days: int = 365, **settings):
        self.object_lock_mode = object_lock_mode
        self.object_lock_days = object_lock_days
        super().__init__(**settings)

    def get_object_parameters(self, name):
        params = super().get_object_parameters(name)
        if self.object_lock_mode:
            params["ObjectLockMode"] = self.object_lock_mode
            params["ObjectLockRetainUntilDate"] = datetime.now(UTC) + timedelta(days=self.object_lock_days)
        return params
