import os
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TextIO

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
        parser.add_argument("-o", "--output", help="write to this file instead of stdout (created mode 0600)")

    def handle(self, *args, username: str, format: str, output: str | None, **options):  # noqa: A002
        scope, call = operator_scope(username)
        # Before the export starts: it is audited and billed as soon as it does.
        target = WholeFile(Path(output)) if output else None
        progress = ExportProgress()
        try:
            progress.say(f"reading the memories of {username!r}")
            lines = memory_export_stream(scope, file_format=format, call=call, progress=progress)
            if target:
                target.write(lines)
            else:
                self._to_stdout(lines)
        except ServiceError as exc:
            raise CommandError(f"{exc.code.value}: {exc.message}") from None
        finally:
            if target:
                target.discard()
        self.stderr.write(f"exported {progress.done} memories of {username!r}" + (f" to {output}" if output else ""))

    def _to_stdout(self, lines: Iterator[str]) -> None:
        try:
            for line in lines:
                self.stdout.write(line, ending="")
            self.stdout.flush()
        except BrokenPipeError:
            # The reader stopped early (`| head`): say so in one line, not a traceback.
            if isinstance(lines, Generator):
                lines.close()  # ends its read-only snapshot now
            wrapped = getattr(self.stdout, "_out", None)
            if wrapped is not None and wrapped is sys.stdout:
                # Python would flush the closed pipe again at exit and print its own error.
                os.dup2(os.open(os.devnull, os.O_WRONLY), wrapped.fileno())
            raise CommandError("stdout was closed before the export ended; it is incomplete") from None


class ExportProgress(ProgressLine):
    """The memories written so far, out of those the file's header counts."""

    def __init__(self) -> None:
        super().__init__("export", noun="memories written")
        self.done = 0

    def __call__(self, done: int, total: int) -> None:
        self.done = done
        super().__call__(done, total)


def _partial_open(path: Path) -> TextIO:
    """A new file only its owner can read (it holds all of a user's memories), never one
    already there or a symlink's target."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    return os.fdopen(fd, "w", encoding="utf-8")


class WholeFile:
    """The export's file appears complete or not at all: written beside it
    (`<name>.partial`), then renamed over it, so an export cut short leaves neither a
    partial file nor a lost earlier one. Opened before the export is read, so a place that
    cannot be written is said before anything is audited or billed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.partial = path.with_name(path.name + ".partial")
        if path.is_dir():
            raise CommandError(f"cannot write the export to {path}: it is a directory")
        try:
            self.partial.unlink(missing_ok=True)  # left by a run killed before its rename
            self.out = _partial_open(self.partial)
        except OSError as exc:
            raise CommandError(f"cannot write the export to {path}: {exc.strerror or exc}") from None

    def write(self, lines: Iterator[str]) -> None:
        try:
            for line in lines:
                self.out.write(line)
            self.out.close()
            os.replace(self.partial, self.path)
        except OSError as exc:
            raise CommandError(
                f"writing the export to {self.path} failed: {exc.strerror or exc}; the file was not written"
            ) from None
        finally:
            if isinstance(lines, Generator):
                lines.close()  # ends its read-only snapshot (a transaction) now, not when collected

    def discard(self) -> None:
        """What is left after a failure: the partial file (none after a success)."""
        self.out.close()
        self.partial.unlink(missing_ok=True)
