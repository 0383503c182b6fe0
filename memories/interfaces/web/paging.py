"""The web UI's list pages (Activity, Trash, Sessions, a session's log and archives,
Decisions, Cached answers): keyset pages (`memories.keyset`) linked by `?cursor=`, an
opaque position sealed for the signed-in user and the list (`memories.cursors`).

A page starts right after (or, for the link back, ends right before) the row the user
saw last, so rows added or deleted while they page through neither repeat nor skip a
row. The position is only where to start: every read is filtered by the signed-in user's
own scope, and a cursor issued to someone else or for another list does not even open."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from django.contrib import messages
from django.utils.http import urlencode

from core.errors import ErrorCode, ServiceError
from memories.cursors import CursorError, PositionKind, position_decode, position_encode
from memories.keyset import KeysetPage, Position, Seek

_AFTER, _BEFORE = "after", "before"


@dataclass(frozen=True)
class Listing:
    """One list of the web UI: its name (a cursor is bound to it) and the kinds of the
    values of its order's key (see memories.cursors.PositionKind)."""

    name: str
    kinds: tuple[PositionKind, ...]


def _bound_to(request, listing: Listing) -> str:
    return f"{request.user.pk}:{listing.name}"


def seek_of(request, listing: Listing) -> Seek | None:
    """Where the request's `cursor` says the page is (None: the first page); an
    `invalid_argument` ServiceError for a cursor this server did not issue to this user for
    this list (garbage, tampered, another user's, another list's)."""
    cursor = request.GET.get("cursor", "")
    if not cursor:
        return None
    kinds: tuple[PositionKind, ...] = ("text", *listing.kinds)  # the direction, then the key
    try:
        direction, *position = position_decode(cursor, kinds=kinds, bound_to=_bound_to(request, listing))
    except CursorError as exc:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"{exc}: showing the first page.") from None
    if direction not in (_AFTER, _BEFORE):
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "cursor is not one this server issued: showing the first page.")
    return Seek(position=tuple(position), backward=direction == _BEFORE)


def page_read[T](request, listing: Listing, read: Callable[[Seek | None], KeysetPage[T]]) -> tuple[KeysetPage[T], int]:
    """The page the request asks for and the status to answer with. A bad cursor is the
    web UI's error shape: its message, a 400, and the first page (never a 500)."""
    try:
        seek = seek_of(request, listing)
    except ServiceError as exc:
        messages.error(request, exc.message)
        return read(None), exc.http_status
    return read(seek), 200


@dataclass(frozen=True)
class Pager:
    """What web/_list_pager.html shows: how many rows this page holds (of `total`, when known)
    and the links to the neighbouring pages."""

    shown: int
    total: int | None
    previous_url: str | None
    next_url: str | None
    total_is_lower_bound: bool = False  # "of more than `total`": the count stopped there


def pager_of(
    request,
    listing: Listing,
    page: KeysetPage,
    *,
    total: int | None = None,
    total_cap: int | None = None,
    keep: Mapping[str, str] | None = None,
) -> Pager:
    """The pager of `page`; its links keep the query parameters `keep` (a filter, the
    session shown). A `total` counted only up to `total_cap` + 1 shows as "more than
    `total_cap`" when it got there."""

    def link(direction: str, position: Position | None) -> str | None:
        if position is None:
            return None
        cursor = position_encode([direction, *position], bound_to=_bound_to(request, listing))
        return "?" + urlencode({**(keep or {}), "cursor": cursor})

    capped = total is not None and total_cap is not None and total > total_cap
    return Pager(
        shown=len(page),
        total=total_cap if capped else total,
        total_is_lower_bound=capped,
        previous_url=link(_BEFORE, page.previous),
        next_url=link(_AFTER, page.next),
    )
