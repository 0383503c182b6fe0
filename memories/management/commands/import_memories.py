from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from core.choices import Operation
from core.errors import ServiceError
from memories.call_record import failures_audited
from memories.management.commands._portability import ImportProgress, operator_scope
from memories.portability import IMPORT_SOURCES, import_items_parse
from memories.services import memory_import


class Command(BaseCommand):
    help = (
        "Import FILE into USER's memories: a memsite JSONL export, a mem0 export JSON or an OpenMemory "
        "export zip. The whole file is validated first; texts the user already has are skipped."
    )

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("file")
        parser.add_argument("--from", dest="source", choices=IMPORT_SOURCES, default="memsite")

    def handle(self, *args, username: str, file: str, source: str, **options):
        scope, call = operator_scope(username)
        path = Path(file)
        if not path.is_file():
            raise CommandError(f"no file {file!r}")
        if path.stat().st_size > settings.IMPORT_MAX_BYTES:
            raise CommandError(f"payload_too_large: the file exceeds {settings.IMPORT_MAX_BYTES} bytes")
        progress = ImportProgress()
        try:
            with failures_audited(scope, call=call, operation=Operation.IMPORT_MEMORIES):
                # Parsed here rather than in memory_import_file so each phase of a long
                # import (validating, embedding, writing) says when it starts.
                progress.say(f"validating {path.name}")
                items = import_items_parse(
                    data=path.read_bytes(),
                    source=source,
                    max_bytes=settings.IMPORT_MAX_BYTES,
                    max_memories=settings.IMPORT_MAX_MEMORIES,
                )
                progress.say(f"checking {len(items)} records against the memories of {username!r}")
                result = memory_import(scope, items=items, source=source, call=call, progress=progress)
        except ServiceError as exc:
            raise CommandError(f"{exc.code.value}: {exc.message}") from None
        self.stdout.write(
            f"imported {result.imported} memories into {username!r}; {result.duplicates} already there were skipped"
            + (f"; {result.expired} already expired were left out" if result.expired else "")
        )
