from datetime import datetime
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from memsite.backup import BackupError, restore
from memsite.management.times import option_time


def _target_time(value: str) -> datetime | None:
    return None if value == "latest" else option_time(value, option="--to", also=" or 'latest'")


class Command(BaseCommand):
    help = (
        "Restore the embedded database into a fresh data dir from the newest base backup before --to, "
        "replaying archived WAL up to that time. The service must be stopped."
    )

    def add_arguments(self, parser):
        parser.add_argument("--to", required=True, help="ISO 8601 time (UTC if no offset) or 'latest'")
        parser.add_argument(
            "--target-dir",
            type=Path,
            default=None,
            help="a new memsite data dir (default: MEMSITE_DATA_DIR, whose postgres/ must be gone or empty)",
        )

    def handle(self, *args, to: str, target_dir: Path | None, **options):
        def say(line: str) -> None:
            self.stdout.write(line)
            self.stdout.flush()

        try:
            report = restore(target_time=_target_time(to), data_dir=target_dir, progress=say)
        except BackupError as exc:
            raise CommandError(str(exc)) from None
        point = report.recovery_point.isoformat() if report.recovery_point else "the end of the base backup"
        self.stdout.write(f"recovery point: {point}")
        for note in report.notes:
            self.stdout.write(note)
