import json
from datetime import datetime
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from memsite.backup import BackupError
from memsite.management.times import option_time
from memsite.services import (
    ErasureEntryInvalid,
    ErasureReapplyReport,
    erasure_entries_check,
    erasures_from_audit,
    erasures_reapply,
    erasures_reapply_after_restore,
)


class Command(BaseCommand):
    help = (
        "Erasures and restores. --since lists erasures from the audit trail (one JSON object a line "
        "with --json: what an operator of an external DATABASE_URL keeps beside their backups). "
        "--reapply re-applies, in a restored data dir, the erasure ledger's erasures after its "
        "recovery point (the launcher runs it at the first start after `restore`). "
        "--reapply-from FILE --after TIME re-applies the erasures listed in FILE after TIME "
        "(e.g. after restoring an external database to TIME)."
    )

    def add_arguments(self, parser):
        group = parser.add_mutually_exclusive_group(required=True)
        group.add_argument("--since", help="list erasures from the audit trail since this ISO 8601 time")
        group.add_argument("--reapply", action="store_true", help="after `manage.py restore`: re-apply from the ledger")
        group.add_argument("--reapply-from", type=Path, help="a file of erasures as `--since ... --json` prints")
        parser.add_argument("--json", action="store_true", help="with --since: one JSON object a line")
        parser.add_argument("--after", help="with --reapply-from: the restored database's recovery point")

    def handle(self, *args, since: str | None, reapply: bool, reapply_from: Path | None, **options):
        if since is not None:
            self._list(option_time(since, option="--since"), as_json=options["json"])
            return
        try:
            if reapply:
                report = erasures_reapply_after_restore(progress=self._say)
                if not report.pending:
                    self._say("no restore left erasures to re-apply here")
                return
            if not options["after"]:
                raise CommandError("--reapply-from needs --after (the restored database's recovery point)")
            entries = self._read(reapply_from)
            report = erasures_reapply(
                entries=entries, after=option_time(options["after"], option="--after"), progress=self._say
            )
            self._summary(report)
        except (BackupError, ErasureEntryInvalid) as exc:  # checked before any erasure is applied
            raise CommandError(str(exc)) from None

    def _say(self, line: str) -> None:
        self.stdout.write(line)
        self.stdout.flush()

    def _summary(self, report: ErasureReapplyReport) -> None:
        self._say(
            f"erasures: {report.reapplied} re-applied, {report.already_in_data} already in the data, "
            f"{report.no_such_user} of users that do not exist here"
        )

    def _read(self, path: Path | None) -> list[dict]:
        """The file's entries, every one checked before any is applied; an error names the line."""
        assert path is not None
        try:
            lines = path.read_text().splitlines()
        except (OSError, ValueError) as exc:
            raise CommandError(f"cannot read {path}: {type(exc).__name__}") from None
        entries: list[dict] = []
        numbers: list[int] = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entries.append(json.loads(line))
            except (ValueError, RecursionError) as exc:  # RecursionError: absurdly nested JSON
                raise CommandError(f"{path} line {number}: not a JSON value ({type(exc).__name__})") from None
            numbers.append(number)
        try:
            erasure_entries_check(entries, line_numbers=numbers)
        except ErasureEntryInvalid as exc:
            raise CommandError(f"{path} {exc}") from None
        return entries

    def _list(self, since: datetime, *, as_json: bool) -> None:
        entries = erasures_from_audit(since=since)
        for entry in entries:
            if as_json:
                self.stdout.write(json.dumps(entry, sort_keys=True))
            else:
                self.stdout.write(
                    f"{entry['erased_at']}  user {entry['user_pk']} ({entry['engine_user_id']})"
                    f"  request {entry['request_id']}" + ("  account deleted" if entry["account_deleted"] else "")
                )
        if not as_json:
            self.stdout.write(f"{len(entries)} erasure(s) since {since.isoformat()}")
