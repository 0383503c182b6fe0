import sys

from django.core.management.base import BaseCommand, CommandError

from core.errors import ServiceError
from memories.engine import EngineError, ReembedProgress
from memories.reembed import (
    EMBEDDER_NAMES,
    embedder_reembed,
    embedder_reembed_abort,
    embedder_reembed_status,
    embedder_target,
)


def _line(progress: ReembedProgress) -> str:
    share = f" ({100 * progress.done / progress.total:.1f}%)" if progress.total else ""
    target = f" -> {progress.target}: {progress.done}/{progress.total}{share}" if progress.target else ""
    return f"embedder {progress.active}{target}"


class Command(BaseCommand):
    help = (
        "Switch the embedder (or its dimensions) online: new vectors are filled in beside the old ones "
        "while search keeps using the old ones, then one short transaction switches. Killed, it resumes "
        "where it stopped when run again. --status shows progress (also on /healthz)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--to", dest="name", choices=EMBEDDER_NAMES)
        parser.add_argument("--dims", type=int, default=None, help="gemini: output dimensionality")
        parser.add_argument("--batch", type=int, default=64, help="rows embedded per batch")
        parser.add_argument("--no-switch", action="store_true", help="fill only; run again to switch")
        parser.add_argument("--status", action="store_true")
        parser.add_argument("--abort", action="store_true", help="drop the new vectors; the old embedder stays")

    def handle(self, *args, name, dims, batch, no_switch, status, abort, **options):
        try:
            if status:
                self.stdout.write(_line(embedder_reembed_status()))
                return
            if abort:
                self.stdout.write(_line(embedder_reembed_abort()))
                return
            if name is None:
                raise CommandError("give --to local|gemini (or --status, --abort)")
            if batch < 1:
                raise CommandError("--batch must be at least 1")
            target = embedder_target(name=name, dims=dims)

            def progress(state: ReembedProgress) -> None:
                sys.stderr.write(_line(state) + "\n")
                sys.stderr.flush()

            result = embedder_reembed(target=target, batch=batch, switch=not no_switch, progress=progress)
        except ServiceError as exc:
            raise CommandError(f"{exc.code.value}: {exc.message}") from None
        except EngineError as exc:
            raise CommandError(f"backend_unavailable: {exc} (run again to resume)") from None
        self.stdout.write(_line(result))
