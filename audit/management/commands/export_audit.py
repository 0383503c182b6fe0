from django.core.management.base import BaseCommand, CommandError

from audit.export import ExportError, ExportReport, audit_export


class Command(BaseCommand):
    help = "Export audit rows not exported yet to STORAGES['audit'] (gzipped JSONL + manifest, object-locked)."

    def add_arguments(self, parser):
        parser.add_argument(
            "--batch-size", type=int, default=None, help="rows per batch (default: AUDIT_EXPORT_BATCH_SIZE)"
        )

    def handle(self, *args, batch_size: int | None, **options):
        if batch_size is not None and batch_size < 1:
            raise CommandError("--batch-size must be at least 1")
        try:
            report = audit_export(batch_size=batch_size, progress=self._progress)
        except ExportError as exc:
            # The batches already recorded stay exported; a rerun resumes after them.
            raise CommandError(f"audit export stopped: {exc}") from None
        self.stdout.write(
            f"exported {report.rows} rows in {report.batches} batches ({report.reused_objects} objects already there)"
        )

    def _progress(self, report: ExportReport) -> None:
        self.stdout.write(f"batch {report.batches}: {report.keys[-1]}, {report.rows} rows exported so far")
        self.stdout.flush()
