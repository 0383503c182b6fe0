"""Keyset pages: a page of a list starts right after (or ends right before) the position of
a row, in an order ending with a unique key, instead of after a number of rows. Rows added
or removed elsewhere in the list while someone pages through it then neither repeat nor
skip a row, and a page costs the same however deep it is (an index on the order finds
the position; OFFSET read and threw away every row before it)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any

from django.db.models import Q, QuerySet

type Position = tuple[Any, ...]


@dataclass(frozen=True)
class Seek:
    """Where a page is: the rows right after `position` in the list's order, or with
    `backward` the rows right before it."""

    position: Position
    backward: bool = False


@dataclass(frozen=True)
class KeysetPage[T]:
    """A page's rows in the list's order, and the positions to seek from for the
    neighbouring pages: `previous` (the first row's, when rows come before it) and `next`
    (the last row's, when rows follow it). Iterating a page iterates its rows."""

    rows: list[T]
    previous: Position | None = None
    next: Position | None = None

    def __iter__(self) -> Iterator[T]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> T:
        return self.rows[index]

    def map[U](self, convert: Callable[[T], U]) -> KeysetPage[U]:
        return KeysetPage(rows=[convert(row) for row in self.rows], previous=self.previous, next=self.next)


# fetch(seek, n): up to n rows beyond `seek` (after it, or before it when backward), the
# nearest first; all the list's rows from its start with seek None.
type Fetch[T] = Callable[[Seek | None, int], Sequence[T]]


def keyset_page[T](fetch: Fetch[T], *, key: Callable[[T], Position], seek: Seek | None, limit: int) -> KeysetPage[T]:
    """The page `seek` asks for (the first with None), `limit` rows at most. One row more
    than the page is read to know whether more follow in its direction, and one row past
    its other edge for the other. A seek past the list's end (its rows were deleted since)
    gives the first page."""
    found = list(fetch(seek, limit + 1))
    if not found and seek is not None:
        return keyset_page(fetch, key=key, seek=None, limit=limit)
    rows, more = found[:limit], len(found) > limit
    if seek is not None and seek.backward:
        rows.reverse()
        behind = bool(fetch(Seek(key(rows[-1])), 1))
        return KeysetPage(rows=rows, previous=key(rows[0]) if more else None, next=key(rows[-1]) if behind else None)
    ahead = seek is not None and bool(fetch(Seek(key(rows[0]), backward=True), 1))
    return KeysetPage(rows=rows, previous=key(rows[0]) if ahead else None, next=key(rows[-1]) if more else None)


def _field(name: str) -> tuple[str, bool]:
    return name.removeprefix("-"), name.startswith("-")


def _beyond(order: Sequence[str], position: Position, *, backward: bool) -> Q:
    """Rows after `position` in `order` (before it, `backward`): lexicographic over the
    order's fields, with the first field's bound stated alone too, so that an index on the
    order starts its scan at the position instead of filtering rows from the list's start."""
    fields = [_field(name) for name in order]
    if len(position) != len(fields):
        raise ValueError("a position has one value per field of the order")
    alternatives = []
    for depth, (name, descending) in enumerate(fields):
        equal = {fields[i][0]: position[i] for i in range(depth)}
        beyond = "lt" if descending != backward else "gt"
        alternatives.append(Q(**equal, **{f"{name}__{beyond}": position[depth]}))
    condition = reduce(operator.or_, alternatives)
    if len(fields) > 1:
        name, descending = fields[0]
        condition &= Q(**{f"{name}__{'lte' if descending != backward else 'gte'}": position[0]})
    return condition


def queryset_fetch(rows: QuerySet[Any], *, order: Sequence[str]) -> Fetch[Any]:
    """`keyset_page`'s fetch over a queryset (model instances or `values()` dicts) in
    `order` (field names, "-" for descending; the last ones a unique key)."""
    backward_order = [name.removeprefix("-") if name.startswith("-") else f"-{name}" for name in order]

    def fetch(seek: Seek | None, limit: int) -> Sequence[Any]:
        if seek is None:
            return list(rows.order_by(*order)[:limit])
        nearest_first = backward_order if seek.backward else order
        beyond = _beyond(order, seek.position, backward=seek.backward)
        return list(rows.filter(beyond).order_by(*nearest_first)[:limit])

    return fetch


def position_of(order: Sequence[str]) -> Callable[[Any], Position]:
    """The position of a row (a model instance or a `values()` dict) in `order`."""
    names = [_field(name)[0] for name in order]

    def key(row: Any) -> Position:
        if isinstance(row, Mapping):
            return tuple(row[name] for name in names)
        return tuple(getattr(row, name) for name in names)

    return key


def queryset_page(rows: QuerySet[Any], *, order: Sequence[str], seek: Seek | None, limit: int) -> KeysetPage[Any]:
    """A keyset page of a queryset in `order` (see queryset_fetch)."""
    return keyset_page(queryset_fetch(rows, order=order), key=position_of(order), seek=seek, limit=limit)
