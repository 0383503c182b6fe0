from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from core.choices import Operation
from core.errors import ServiceError
from memories.call_record import failures_audited
from memories.management.commands._portability import ProgressLine, operator_scope
from memories.portability import EXPORT_FORMATS
from memories.services import memory_export


class Command(BaseCommand):
    help = "Export all memories of USER (JSONL, lossless, or Markdown) to stdout or a file. Audited and billed."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--format", choices=EXPORT_FORMATS, default="jsonl")
        parser.add_argument("-o", "--output", help="write to this file instead of stdout")

    def handle(self, *args, username: str, format: str, output: str | None, **options):  # noqa: A002
        scope, call = operator_scope(username)
        progress = ProgressLine("export", noun="memories read")
        progress.say(f"reading the memories of {username!r}")
        try:
            with failures_audited(scope, call=call, operation=Operation.EXPORT_MEMORIES):
                result = memory_export(scope, file_format=format, call=call, progress=progress)
        except ServiceError as exc:
            raise CommandError(f"{exc.code.value}: {exc.message}") from None
        if output:
            Path(output).write_text(result.content, encoding="utf-8")
        else:
            self.stdout.write(result.content, ending="")
        self.stderr.write(f"exported {result.count} memories of {username!r}" + (f" to {output}" if output else ""))
