"""The admin's lists of the tables that grow per call never read a whole table per page
(docs/architecture.md, "Validation at the edge"): the memories page (mem0's table),
unfiltered and each kind of search, the memory history and the chat turns, each read
through an index. The plans are read with sequential scans priced out, as in
tests/test_audit.py: what remains is the best plan the indexes allow, and a page that has
to sort the table shows a Sort.

On tables of a few rows, plans the planner prices alike (a lookup through the index a
check names, or a walk of another index filtering every row; a parameterised nested loop
or a join filter) are a coin toss that statistics decide, and autovacuum analyses tables
while a worker runs. So each check prices out every plan but those it accepts: plain index
scans where it asks for an index condition (a bitmap scan needs one), sorts where it asks
for the index's order, and the other index that gives the same order is dropped for the
check (rolled back). What remains does not depend on the statistics, and a missing index
still shows as a Seq Scan, a Sort or another index."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from core.scope import MemoryScope
from memories.engine.vector_schema import owner_fulltext_index_name
from memories.models import RateWindow
from memories.services import memory_delete, memory_remember
from memories.tenancy import tenant_create, tenant_user_create
from memsite.models import ErasureLedger
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

MEMORIES = "/admin/memories/enginememoryrow/"
PAGING_INDEX = f"{settings.MEMORY_COLLECTION}_user_created_idx"
FULLTEXT_INDEX = f"{settings.MEMORY_COLLECTION}_fts_idx"
# Migration memories 0027 (vector_schema.create_admin_indexes).
CREATED_INDEX = f"{settings.MEMORY_COLLECTION}_created_idx"
TRASH_FULLTEXT_INDEX = f"{settings.MEMORY_COLLECTION}_trash_fts_idx"
# Migration memories 0028: the trash in its order, also partial on the trashed rows.
TRASH_ORDER_INDEX = f"{settings.MEMORY_COLLECTION}_trash_order_idx"


@pytest.fixture
def memories(alice, bob):
    """Alice (default tenant) with a live and a trashed memory, Bob, and Carol of another
    tenant: {name: memory id}."""
    tenant_create(name="acme")
    carol = tenant_user_create(tenant="acme", username="carol")

    def remember(user, text: str) -> str:
        return memory_remember(MemoryScope.for_user(user), memory=text, call=internal_call()).id

    ids = {
        "alice": remember(alice, "Alice bakes sourdough bread on Sundays"),
        "alice_trashed": remember(alice, "Alice knits woollen scarves"),
        "bob": remember(bob, "Bob is baking rye for the neighbours"),
        "carol": remember(carol, "Carol grows tomatoes on her balcony"),
    }
    memory_delete(MemoryScope.for_user(alice), memory_id=ids["alice_trashed"], call=internal_call())
    ids["carol_pk"] = carol.pk
    return ids


def _page(admin_client, url: str, params: dict[str, str] | None = None):
    page = admin_client.get(url, params or {})
    assert page.status_code == 200, (url, params)
    return page.context["cl"]


def _plan(changelist, *, priced_out: tuple[str, ...] = ("seqscan",), without: tuple[str, ...] = ()) -> str:
    """EXPLAIN of the page's own query (ordered as the admin orders it, one page long),
    with these plan nodes priced out and these indexes dropped (constants of the tests),
    in a transaction rolled back."""
    with transaction.atomic(), connection.cursor() as cursor:
        for index in without:
            cursor.execute(f'DROP INDEX "{index}"')
        for node in priced_out:
            cursor.execute(f"SET LOCAL enable_{node} = off")
        plan = changelist.queryset[: changelist.list_per_page].explain()
        transaction.set_rollback(True)
    return plan


# Where a page's order must come from an index: sorting priced out too, so a Sort shows
# only where no index gives the order. A table of a few rows lets the planner sort them
# instead (nested loop, then Sort), a coin toss that failed CI once.
IN_ORDER = ("seqscan", "sort")
# Where a check names the index that finds the rows: plain index scans priced out too, so
# every table is read through a bitmap of an index condition (or a Seq Scan). A table of a
# few rows otherwise lets the planner walk another index filtering each row (the order's
# index, or auth_user's primary key testing each username, which failed CI once), or join
# the searched users by a filter over the table's whole index.
BY_CONDITION = ("seqscan", "indexscan")


def _found(admin_client, term: str) -> set[str]:
    return {str(row.id) for row in _page(admin_client, MEMORIES, {"q": term}).result_list}


def test_memories_page_searches_find_the_right_rows(admin_client, alice, bob, memories):
    # user:<pk>: the user's rows, live and trashed, whichever tenant, nobody else's.
    assert _found(admin_client, f"user:{alice.pk}") == {memories["alice"], memories["alice_trashed"]}
    assert _found(admin_client, f"user:{bob.pk}") == {memories["bob"]}
    assert _found(admin_client, f"user:{memories['carol_pk']}") == {memories["carol"]}
    assert _found(admin_client, " user:999999 ") == set()
    # A memory id, however it was pasted.
    assert _found(admin_client, memories["bob"].upper()) == {memories["bob"]}
    assert _found(admin_client, uuid.UUID(memories["carol"]).hex) == {memories["carol"]}
    assert _found(admin_client, str(uuid.uuid4())) == set()
    # Words: whole words in any inflection, live or trashed rows, any user's.
    assert _found(admin_client, "sourdough") == {memories["alice"]}
    assert _found(admin_client, "bake") == {memories["alice"], memories["bob"]}
    assert _found(admin_client, "Scarves") == {memories["alice_trashed"]}
    assert _found(admin_client, '"woollen scarves"') == {memories["alice_trashed"]}
    assert _found(admin_client, "tomatoes balcony") == {memories["carol"]}
    assert _found(admin_client, "tomatoes sourdough") == set()  # every word, not any
    for nothing in ("no such words", "the", "user:abc", "!!", "&|:*"):  # no error either
        assert _found(admin_client, nothing) == set(), nothing
    # Unfiltered: every row, newest first.
    listed = [str(row.id) for row in _page(admin_client, MEMORIES).result_list]
    assert listed == [memories[k] for k in ("carol", "bob", "alice_trashed", "alice")]


def test_memories_page_of_a_deleted_account_finds_its_rows(admin_client, memories, django_user_model):
    """Rows a deleted account left behind (deleted outside the erasing user admin) are
    still found by `user:<pk>`, in whichever tenant they are."""
    django_user_model.objects.filter(pk=memories["carol_pk"]).delete()
    assert _found(admin_client, f"user:{memories['carol_pk']}") == {memories["carol"]}


def test_memories_page_reads_through_indexes(admin_client, alice, memories):
    unfiltered = _plan(_page(admin_client, MEMORIES), priced_out=IN_ORDER)
    # 100 entries of the (created_at, id) index read backwards: no sort of every row.
    assert f"Index Scan Backward using {CREATED_INDEX}" in unfiltered, unfiltered
    assert "Sort" not in unfiltered and "Seq Scan" not in unfiltered, unfiltered

    # One user: an exact lookup of their partition in the paging index (owner, created_at,
    # id). A small user's few rows may be sorted; the index also gives them in order,
    # which is the plan once sorting them costs more. In order, the (created_at, id) index
    # walked testing each row's owner gives it too, at a small table's equal cost: it is
    # dropped for that check.
    owned_page = _page(admin_client, MEMORIES, {"q": f"user:{alice.pk}"})
    owned = _plan(owned_page, priced_out=BY_CONDITION)
    assert f"Index Cond: ((payload ->> 'user_id'::text) = 'default:{alice.pk}'::text)" in owned, owned
    assert PAGING_INDEX in owned and "Seq Scan" not in owned, owned
    in_order = _plan(owned_page, priced_out=("seqscan", "sort", "bitmapscan"), without=(CREATED_INDEX,))
    assert f"Index Scan Backward using {PAGING_INDEX}" in in_order and "Sort" not in in_order, in_order

    # By id: the primary key, even with sorting priced out (newest first let a small
    # table's plan walk the (created_at, id) index testing each entry's id). The paging
    # index (owner, created_at, id) is dropped for it: PostgreSQL 18's skip scan reads a
    # small table's few owners through it for `id =` at the primary key's equal cost.
    by_id = _plan(
        _page(admin_client, MEMORIES, {"q": memories["bob"]}), priced_out=("seqscan", "sort"), without=(PAGING_INDEX,)
    )
    assert f"{settings.MEMORY_COLLECTION}_pkey" in by_id and "Seq Scan" not in by_id, by_id

    # Words: the live rows' full-text index (search's) ORed with the trashed rows', and
    # the matches sorted; never the (created_at, id) index walked testing every row's
    # words, which reads the whole table when matches are few or none.
    words = _plan(_page(admin_client, MEMORIES, {"q": "sourdough bread"}), priced_out=BY_CONDITION)
    scans = set(re.findall(r"Bitmap Index Scan on (\w+)", words))
    # (owner, fts) where the server has btree_gin (migration 0017), fts alone otherwise.
    live_index = owner_fulltext_index_name() if owner_fulltext_index_name() in words else FULLTEXT_INDEX
    # The trashed rows through either index partial on them (the planner takes the trash
    # order index while the trash is small): never more than the trash.
    assert live_index in scans and len(scans) == 2, words
    assert scans - {live_index} <= {TRASH_FULLTEXT_INDEX, TRASH_ORDER_INDEX}, words
    assert "Seq Scan" not in words and CREATED_INDEX not in words, words
    walk_priced_out = _plan(_page(admin_client, MEMORIES, {"q": "sourdough bread"}), priced_out=("seqscan", "sort"))
    assert CREATED_INDEX not in walk_priced_out, walk_priced_out  # no plan of the page can use it


def test_memory_history_and_chat_turn_pages_read_through_indexes(admin_client, memories):
    # Filtered by event, history_recent walked testing each row's event gives the order too,
    # at a small table's equal cost: it is dropped for that check.
    for url, params, index, without in (
        ("/admin/audit/memoryhistory/", {}, "history_recent", ()),
        ("/admin/audit/memoryhistory/", {"event__exact": "RESTORE"}, "history_event_recent", ("history_recent",)),
        ("/admin/proxy/proxyturn/", {}, "proxy_turn_recent", ()),
    ):
        plan = _plan(_page(admin_client, url, params), priced_out=IN_ORDER, without=without)
        assert f"Index Scan using {index}" in plan, plan  # defined newest first
        assert "Sort" not in plan and "Seq Scan" not in plan, plan
    # The history page still lists every version, newest first.
    versions = _page(admin_client, "/admin/audit/memoryhistory/").result_list
    assert [v.recorded_at for v in versions] == sorted((v.recorded_at for v in versions), reverse=True)
    assert {v.memory_id for v in versions} >= {memories["alice"], memories["bob"], memories["carol"]}


RATE_WINDOWS = "/admin/memories/ratewindow/"


@pytest.fixture
def rate_windows(alice, bob, django_user_model):
    """Windows of alice, alicia (a username alice's is a prefix of), bob, and a service
    credential's own window under bob's account: {name: window pk}."""
    alicia = django_user_model.objects.create_user("alicia", "alicia@example.com", "alicia-password-1")
    start = datetime(2026, 11, 28, 9, 30, tzinfo=UTC)

    def window(user, operation: str, minutes: int = 0) -> int:
        at = start + timedelta(minutes=minutes)
        return RateWindow.objects.create(user=user, operation=operation, window_start=at, window_seconds=60).pk

    return {
        "alice_remember": window(alice, "remember"),
        "alice_search": window(alice, "search_memory", minutes=1),
        "alicia_remember": window(alicia, "remember", minutes=2),
        "bob_search": window(bob, "search_memory", minutes=3),
        "bob_credential": window(bob, "remember@key:k-service", minutes=4),
        "alicia_pk": alicia.pk,
    }


def _windows(admin_client, params: dict[str, str]) -> set[int]:
    return {row.pk for row in _page(admin_client, RATE_WINDOWS, params).result_list}


def test_rate_window_page_filters_by_operation_without_reading_every_window(admin_client, rate_windows):
    with CaptureQueriesContext(connection) as queries:
        page = admin_client.get(RATE_WINDOWS)
    assert page.status_code == 200
    # The filter's choices are the rate-limited operations, not a DISTINCT over the table.
    assert not [q["sql"] for q in queries.captured_queries if "DISTINCT" in q["sql"].upper()]
    (operation_filter,) = page.context["cl"].filter_specs
    choices = {value for value, _ in operation_filter.lookup_choices}
    assert {"remember", "search_memory", "chat_completion"} <= choices
    assert choices <= set(settings.RATE_LIMITS) and "remember@key:k-service" not in choices

    ids = rate_windows
    assert _windows(admin_client, {"operation": "remember"}) == {ids["alice_remember"], ids["alicia_remember"]}
    assert _windows(admin_client, {"operation": "search_memory"}) == {ids["alice_search"], ids["bob_search"]}
    # Newest first, every window.
    listed = [row.pk for row in _page(admin_client, RATE_WINDOWS).result_list]
    newest_first = ("bob_credential", "bob_search", "alicia_remember", "alice_search", "alice_remember")
    assert listed == [ids[k] for k in newest_first]


def test_rate_window_page_searches_users_exactly_or_by_prefix(admin_client, alice, bob, rate_windows):
    ids = rate_windows
    alices = {ids["alice_remember"], ids["alice_search"]}
    assert _windows(admin_client, {"q": "alice"}) == alices  # exact: not alicia's
    assert _windows(admin_client, {"q": " ali* "}) == alices | {ids["alicia_remember"]}
    assert _windows(admin_client, {"q": "alicia*"}) == {ids["alicia_remember"]}
    assert _windows(admin_client, {"q": str(bob.pk)}) == {ids["bob_search"], ids["bob_credential"]}
    assert _windows(admin_client, {"q": str(ids["alicia_pk"])}) == {ids["alicia_remember"]}
    assert len(_windows(admin_client, {"q": "*"})) == 5  # no prefix: every window
    # Not a substring, not case-folded, and LIKE's wildcards are plain characters.
    for nothing in ("lic", "ALICE", "Ali*", "%*", "_lice*", "a%*", "9" * 30, "\u00b2"):
        assert _windows(admin_client, {"q": nothing}) == set(), nothing


def test_rate_window_page_reads_through_indexes(admin_client, alice, rate_windows):
    plan = _plan(_page(admin_client, RATE_WINDOWS), priced_out=IN_ORDER)
    assert "Index Scan using rate_window_recent on memories_ratewindow" in plan, plan  # defined newest first
    assert "Sort" not in plan and "Seq Scan" not in plan, plan
    # By operation: the two windows found may be sorted; the index also gives them in
    # order, which is the plan once sorting them costs more. In order, rate_window_recent
    # walked testing each window's operation gives it too: it is dropped for that check.
    filtered = _page(admin_client, RATE_WINDOWS, {"operation": "remember"})
    plan = _plan(filtered, priced_out=("seqscan", "sort", "bitmapscan"), without=("rate_window_recent",))
    assert "Index Scan using rate_window_operation_recent on memories_ratewindow" in plan, plan
    assert "Sort" not in plan and "Seq Scan" not in plan, plan
    plan = _plan(filtered, priced_out=BY_CONDITION)
    assert "Seq Scan" not in plan and "Index Cond: ((operation)::text = 'remember'::text)" in plan, plan
    assert "rate_window_operation_recent" in plan, plan
    # The hourly prune finds the old windows through the same index as the page.
    with transaction.atomic(), connection.cursor() as cursor:
        for node in BY_CONDITION:
            cursor.execute(f"SET LOCAL enable_{node} = off")
        prune = RateWindow.objects.filter(window_start__lt=datetime(2026, 11, 28, tzinfo=UTC)).explain()
    assert "rate_window_recent" in prune and "Seq Scan" not in prune, prune

    # A search finds the users through auth_user's indexes, then only their windows
    # (which may be sorted: one user's, not the table).
    # A prefix is a range of either username index: the pattern one's, or the unique one's,
    # which the database's C collation orders the same (at a few users' equal cost).
    prefix_range = r"\(\(username\)::text (~>=~|>=) 'ali'::text\) AND \(\(username\)::text (~<~|<) 'alj'::text\)"
    for term, user_cond in (
        ("alice", re.escape("Index Cond: ((username)::text = 'alice'::text)")),  # either username index
        ("ali*", rf"Index Cond: \({prefix_range}\)"),
        (str(alice.pk), re.escape(f"Index Cond: (id = {alice.pk})")),
    ):
        plan = _plan(_page(admin_client, RATE_WINDOWS, {"q": term}), priced_out=BY_CONDITION)
        assert re.search(user_cond, plan) and "Seq Scan" not in plan and "upper(" not in plan, plan
        assert re.search(r"Index Cond: \(user_id = (auth_user|u0)\.id\)", plan), plan


def test_erasure_ledger_search_is_exact_and_index_served(admin_client, alice, bob):
    """`=user_pk` was iexact: upper() of every row's user id as text, a sequential scan
    of a ledger that keeps a row per erasure for good."""
    now = timezone.now()

    def erasure(user, request_id: str) -> uuid.UUID:
        row = ErasureLedger.objects.create(
            id=uuid.uuid4(), user_pk=user.pk, engine_user_id=f"default:{user.pk}", request_id=request_id, erased_at=now
        )
        return row.id

    request_id = str(uuid.uuid4())
    alices = erasure(alice, request_id)
    bobs = erasure(bob, str(uuid.uuid4()))
    url = "/admin/memsite/erasureledger/"

    def found(term: str) -> set[uuid.UUID]:
        return {row.id for row in _page(admin_client, url, {"q": term}).result_list}

    assert found(str(alice.pk)) == {alices} and found(f" {bob.pk} ") == {bobs}
    assert found(request_id) == found(request_id.upper()) == found(uuid.UUID(request_id).hex) == {alices}
    assert found("") == {alices, bobs}
    for nothing in (request_id[:8], "abc", "-1", "9" * 30, "\u00b2"):
        assert found(nothing) == set(), nothing
    for term, index, cond in (
        (str(alice.pk), "erasure_ledger_user", f"(user_pk = {alice.pk})"),
        (request_id, "erasure_ledger_request", f"((request_id)::text = '{request_id}'::text)"),
    ):
        plan = _plan(_page(admin_client, url, {"q": term}), priced_out=BY_CONDITION)
        assert index in plan and f"Index Cond: {cond}" in plan, plan
        assert "Seq Scan" not in plan and "upper(" not in plan, plan


# The changelists of the tables that grow with use, and the columns each may be sorted by:
# those whose order an index serves. Both ways: "both" when the index serves them without
# any sort, "ties" when only rows of one timestamp may be left to sort (Incremental Sort).
LARGE_TABLE_SORTS = {
    "/admin/audit/auditevent/": ({"id"}, "both"),
    "/admin/audit/memoryhistory/": ({"recorded_at"}, "both"),
    "/admin/billing/usageevent/": ({"created_at"}, "ties"),
    "/admin/memories/ratewindow/": ({"window_start"}, "both"),
    "/admin/memories/enginememoryrow/": (set(), "both"),
    "/admin/proxy/proxyturn/": ({"created_at"}, "both"),
    "/admin/audit/authfailurewindow/": ({"window_start"}, "ties"),
    "/admin/toolkit/decision/": (set(), "both"),
    "/admin/toolkit/cacheentry/": (set(), "both"),
}
WHOLE_SORT = re.compile(r"^\s*(->\s+)?Sort  \(", re.MULTILINE)  # a Sort node, not an Incremental Sort


def test_large_tables_sort_only_by_columns_an_index_serves(admin_client, memories, rate_windows):
    from django.contrib.admin.templatetags.admin_list import result_headers

    for url, (sortable, served) in LARGE_TABLE_SORTS.items():
        default = _page(admin_client, url)
        assert not default.add_facets and not default.is_facets_optional, url  # no COUNT per choice
        assert not default.show_full_result_count, url
        headers = list(result_headers(default))
        linked = {default.list_display[i] for i, header in enumerate(headers) if header["sortable"]}
        assert linked == sortable, url
        # Every column either way, as a header link or an address typed or kept would ask:
        # an unsortable one leaves the default order; none sorts the table.
        for column, field in enumerate(default.list_display):
            for direction in ("", "-"):
                changelist = _page(admin_client, url, {"o": f"{direction}{column}"})
                if field not in sortable:
                    assert changelist.queryset.query.order_by == default.queryset.query.order_by, (url, field)
                plan = _plan(changelist, priced_out=IN_ORDER)
                assert "Seq Scan" not in plan and not WHOLE_SORT.search(plan), (url, field, direction, plan)
                if served == "both":
                    assert "Sort" not in plan, (url, field, direction, plan)


def test_decisions_and_cached_answers_are_found_by_exact_user_through_indexes(admin_client, alice, bob):
    from memories.toolkit.models import CacheEntry, Decision

    now = timezone.now()
    rows = {}
    for user in (alice, bob):
        rows[("decision", user.pk)] = Decision.objects.create(
            user=user, key="k", value="v", created_at=now, updated_at=now
        ).pk
        rows[("cacheentry", user.pk)] = CacheEntry.objects.create(
            user=user, query="q", response="r", embedding=[0.1, 0.2, 0.3], expires_at=now + timedelta(days=1)
        ).pk
    for model in ("decision", "cacheentry"):
        url = f"/admin/toolkit/{model}/"

        def found(term: str, url=url) -> set:
            return {row.pk for row in _page(admin_client, url, {"q": term}).result_list}

        assert found("alice") == found(str(alice.pk)) == {rows[(model, alice.pk)]}, model
        assert found(f" {bob.pk} ") == {rows[(model, bob.pk)]}, model
        for nothing in ("lic", "ALICE", "ali", "9" * 30):  # exact only
            assert found(nothing) == set(), (model, nothing)
        for term in ("alice", str(alice.pk)):
            plan = _plan(_page(admin_client, url, {"q": term}), priced_out=BY_CONDITION)
            assert "Seq Scan" not in plan and "upper(" not in plan, plan
            assert re.search(r"Index Cond: \(user_id = (auth_user|u0)\.id\)", plan), plan
