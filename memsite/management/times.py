"""Reading a time from a management command's option (restore --to, erasures --since/--after)."""

from datetime import UTC, datetime

from django.core.management.base import CommandError


def option_time(value: str, *, option: str, also: str = "") -> datetime:
    """An ISO 8601 time, UTC when it names no offset (TIME_ZONE is UTC); CommandError
    naming the option otherwise. `also`: the option's other accepted words, for the message."""
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise CommandError(f"{option} must be an ISO 8601 time{also}, not {value!r}") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
