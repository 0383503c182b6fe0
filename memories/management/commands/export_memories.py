import os
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from core.errors import ServiceError
from memories.management.commands._portability import ProgressLine, operator_scope
from memories.portability import EXPORT_FORMATS
from memories.services import memory_export_stream


class Command(BaseCommand):
    help = (
        "Export all memories of USER (JSONL, lossless, or Markdown) to stdout or a file, written as it is read "
        "(one consistent snapshot). Audited and billed."
    )

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--format", choices=EXPORT_FORMATS, default="jsonl")
        parser.add_argument("-o", "--output", help="write to this file instead of stdout")

    def handle(self, *args, username: str, format: str, output: str | None, **options):  # noqa: A002
        scope, call = operator_scope(username)
        progress = ExportProgress()
        progress.say(f"reading the memories of {username!r}")
        try:
            lines = memory_export_stream(scope, file_format=format, call=call, progress=progress)
            if output:
                _write_whole(Path(output), lines)
            else:
                for line in lines:
                    self.stdout.write(line, ending="")
        except ServiceError as exc:
            raise CommandError(f"{exc.code.value}: {exc.message}") from None
        self.stderr.write(f"exported {progress.done} memories of {username!r}" + (f" to {output}" if output else ""))


class ExportProgress(ProgressLine):
    """The memories written so far, out of those the file's header counts."""

    def __init__(self) -> None:
        super().__init__("export", noun="memories written")
        self.done = 0

    def __call__(self, done: int, total: int) -> None:
        self.done = done
        super().__call__(done, total)


def _write_whole(path: Path, lines) -> None:
    """The file appears complete or not at all: written beside it, then renamed over it
    (an export cut short leaves neither a partial file nor a lost earlier one)."""
    partial = path.with_name(path.name + ".partial")
    try:
        with partial.open("w", encoding="utf-8") as out:
            for line in lines:
                out.write(line)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
