from django.core.management.base import BaseCommand, CommandError

from memsite.backup import BackupError, archive_status, backup_base, backup_base_if_due


class Command(BaseCommand):
    help = "Take a base backup of the embedded database now (WAL is archived continuously), or list backups."

    def add_arguments(self, parser):
        group = parser.add_mutually_exclusive_group()
        group.add_argument("--list", action="store_true", help="list base backups and the WAL archive")
        group.add_argument("--if-due", action="store_true", help="only when the newest is older than the interval")

    def handle(self, *args, list: bool, if_due: bool, **options):  # noqa: A002 - the option's name
        try:
            if list:
                self._list()
            elif if_due:
                meta = backup_base_if_due(progress=self._say)
                self.stdout.write(meta["label"] if meta else "a recent base backup exists; nothing to do")
            else:
                backup_base(progress=self._say)
        except BackupError as exc:
            raise CommandError(str(exc)) from None

    def _say(self, line: str) -> None:
        self.stdout.write(line)
        self.stdout.flush()

    def _list(self) -> None:
        status = archive_status()
        self.stdout.write(f"target: {status.target}")
        for meta in status.backups:
            size = sum(f["size"] for f in meta["files"].values()) / 1e6
            self.stdout.write(
                f"{meta['label']}  finished {meta['finished_at']}  {size:.1f} MB  from WAL {meta['start_wal']}"
                f"  (PostgreSQL {meta['server_version']})"
            )
        for why in status.unreadable:  # damaged backup.json: restore and retention skip it
            self.stdout.write(f"skipped: {why}")
        if not status.backups:
            self.stdout.write("no base backups")
        newest = (
            f", newest {status.newest_wal} at {status.newest_wal_at.isoformat()}"
            if status.newest_wal and status.newest_wal_at
            else ""
        )
        self.stdout.write(f"WAL archive: {status.wal_files} segments{newest}")
        if status.archiver:
            a = status.archiver
            line = f"server: archive_mode={a['archive_mode']}, {a['archived_count']} archived since its start"
            if a["failed_count"]:
                line += (
                    f", {a['failed_count']} failed attempts (last {a['last_failed_wal']} at {a['last_failed_time']})"
                )
            self.stdout.write(line)
