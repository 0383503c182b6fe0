from django.core.management.base import BaseCommand

from audit.export import audit_export


class Command(BaseCommand):
    help = "Export audit rows not exported yet to STORAGES['audit'] (gzipped JSONL + manifest, object-locked)."

    def add_arguments(self, parser):
        parser.add_argument("--batch-size", type=int, default=None)

    def handle(self, *args, batch_size: int | None, **options):
        report = audit_export(batch_size=batch_size)
        self.stdout.write(
            f"exported {report.rows} rows in {report.batches} batches ({report.reused_objects} objects already there)"
        )
