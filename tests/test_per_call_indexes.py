"""The tables a billed call writes to (audit rows, memory history, usage events, chat
turns, ingest intents, mem0's raw messages, rate and 401 windows, the sliding windows'
calls, failed sign-ins) keep exactly the
indexes some query or constraint needs: each costs every insert. Django's `db_index=True`
or `unique=True` on a CharField also builds a varchar_pattern_ops "_like" twin, read only
by LIKE 'prefix%' under a non-C collation, and nothing here searches an id by prefix
(audit 0023, billing 0004, proxy 0007, memories 0032); nor is any index a left prefix of
another with the same predicate. The lookups by those ids still read an index, and a
user's usage events in a time range read only that range (billing 0005)."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.migrations.executor import MigrationExecutor
from django.db.models import Q
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from audit.models import AuditEvent, AuthFailureWindow, LoginFailure, MemoryHistory
from billing.models import UsageEvent
from core.scope import MemoryScope
from memories.models import EngineMessage, IngestIntent, RateEvent, RateWindow
from memories.selectors import usage_by_day
from proxy.models import ProxyTurn

pytestmark = pytest.mark.django_db

# Every index of each table, as `UNIQUE? <method> (<columns>) <WHERE ...>` (pg_indexes).
EXPECTED = {
    AuditEvent: {
        "audit_auditevent_pkey": "UNIQUE btree (id)",
        "audit_request": "btree (request_id)",
        "audit_subject_recent": "btree (subject_user_id, id DESC)",
        "audit_operation_recent": "btree (operation, id DESC)",
        "audit_outcome_recent": "btree (outcome, id DESC)",
        "audit_occurred_at": "btree (occurred_at)",
        "audit_turn": "btree (turn_id, id) WHERE (NOT ((turn_id)::text = ''::text))",
        "audit_actor_recent": "btree (actor_user_id, id DESC) WHERE (NOT ((actor_user_id = subject_user_id)"
        " AND (actor_user_id IS NOT NULL) AND (subject_user_id IS NOT NULL)))",
        "audit_actor_name_recent": "btree (actor_username, id DESC)",
        "audit_staff_recent": "btree (staff_user_id, id DESC) WHERE (staff_user_id IS NOT NULL)",
        "audit_staff_name_recent": "btree (staff_username, id DESC) WHERE (NOT ((staff_username)::text = ''::text))",
        "audit_credential_recent": "btree (actor_credential, id DESC)"
        " WHERE (NOT ((actor_credential)::text = ''::text))",
        "audit_memory_ids": "gin (memory_ids)",
    },
    MemoryHistory: {
        "audit_memoryhistory_pkey": "UNIQUE btree (id)",
        "history_request": "btree (request_id)",
        "audit_memor_memory__49f0b1_idx": "btree (memory_id, recorded_at)",
        "history_owner": "btree (engine_user_id) WHERE (NOT ((engine_user_id)::text = ''::text))",
        "history_recent": "btree (recorded_at DESC, id DESC)",
        "history_event_recent": "btree (event, recorded_at DESC, id DESC)",
    },
    UsageEvent: {
        "billing_usageevent_pkey": "UNIQUE btree (id)",
        "billing_usageevent_request_id_key": "UNIQUE btree (request_id)",  # the gateway's idempotency key
        # A user's events by time (their usage page, the admin's search by user id).
        "usage_event_user_created": "btree (user_id, created_at)",
        # The admin's list, newest first, and its date filter; not a prefix of the partial
        # usage_event_failed, which holds the failed rows only.
        "billing_usageevent_created_at_340b6605": "btree (created_at)",
        "billing_usa_operati_cc9d10_idx": "btree (operation, created_at)",
        "usage_event_undelivered": "btree (next_attempt_at) WHERE ((status)::text = 'pending'::text)",
        "usage_event_failed": "btree (created_at DESC) WHERE ((status)::text = 'failed'::text)",
    },
    ProxyTurn: {
        "proxy_proxyturn_pkey": "UNIQUE btree (id)",
        "proxy_proxyturn_request_id_key": "UNIQUE btree (request_id)",
        # The user's turns: their erasure and Django's ON DELETE CASCADE from auth_user.
        "proxy_proxyturn_user_id_872eb225": "btree (user_id)",
        # Partial on the turns owed work or a person, and the closed ones by close time
        # for the prune (proxy 0008).
        "proxy_turn_pending": "btree (created_at DESC, id DESC) WHERE ((state)::text = 'pending'::text)",
        "proxy_turn_failed": "btree (created_at DESC, id DESC) WHERE ((state)::text = 'failed'::text)",
        "proxy_turn_closed_at": "btree (closed_at) WHERE (NOT ((state)::text = 'pending'::text))",
        "proxy_turn_recent": "btree (created_at DESC, id DESC)",
    },
    IngestIntent: {
        "memories_ingestintent_pkey": "UNIQUE btree (id)",
        "ingest_intent_request_unique": "UNIQUE btree (request_id)",  # one intent per call
        # Every user's open ones by age: the reconciler and the /metrics gauge (memories 0036).
        "ingest_intent_open_created": "btree (created_at) WHERE ((state)::text = 'open'::text)",
        # A user's open ones, in pk order: marked by their erasure or clear-all, unmarked by its undo.
        "ingest_intent_user_open": "btree (engine_user_id, id) WHERE ((state)::text = 'open'::text)",
        # A user's closed ones (their erasure), and every closed one by age (the prune).
        "ingest_intent_user_closed": "btree (engine_user_id) WHERE (NOT ((state)::text = 'open'::text))",
        "ingest_intent_closed_at": "btree (closed_at) WHERE (NOT ((state)::text = 'open'::text))",
    },
    EngineMessage: {
        "memories_enginemessage_pkey": "UNIQUE btree (id)",
        "engine_message_scope": "btree (session_scope)",
        "engine_message_user": "btree (user_id)",
        # No created_at index: only a session's own rows are ordered by it (memories 0036).
    },
    RateWindow: {
        "memories_ratewindow_pkey": "UNIQUE btree (id)",
        "rate_window_unique": "UNIQUE btree (user_id, operation, window_seconds, window_start)",
        "rate_window_recent": "btree (window_start DESC, id DESC)",
        "rate_window_operation_recent": "btree (operation, window_start DESC, id DESC)",
    },
    AuthFailureWindow: {
        "audit_authfailurewindow_pkey": "UNIQUE btree (id)",
        "auth_failure_window_unique": "UNIQUE btree (ip, window_start)",
        "auth_failure_window_start": "btree (window_start)",  # the prune and the admin's order
    },
    RateEvent: {
        "memories_rateevent_pkey": "UNIQUE btree (id)",
        # A key's calls in its window; also every lookup by user (the user's own index,
        # a prefix of it, was dropped: memories 0037).
        "memories_ra_user_id_15dfa5_idx": "btree (user_id, operation, at)",
        "rate_event_at": "btree (at)",  # every key's old calls: the prune (memories 0037)
    },
    LoginFailure: {
        "audit_loginfailure_pkey": "UNIQUE btree (id)",
        "login_failure_key_at": "btree (key, at)",  # a key's failures in the window
        "login_failure_at": "btree (at)",  # every key's failures out of it: the prune (audit 0024)
    },
}

_DEFINITION = re.compile(r"^CREATE (UNIQUE )?INDEX \S+ ON \S+ USING (.*)$")


def _indexes(table: str) -> dict[str, str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", [table])
        found = {}
        for name, definition in cursor.fetchall():
            unique, rest = _DEFINITION.match(definition).groups()
            found[name] = f"{unique or ''}{rest}"
    return found


@pytest.mark.parametrize("model", list(EXPECTED), ids=lambda model: model.__name__)
def test_per_call_tables_keep_exactly_the_indexes_they_need(model):
    indexes = _indexes(model._meta.db_table)
    assert indexes == EXPECTED[model]
    for name, definition in indexes.items():
        assert "pattern_ops" not in definition, (name, definition)


def _parts(definition: str) -> tuple[str, list[str], str]:
    """(method, columns, predicate) of an index as _indexes shows it; a column's pattern
    operator class left out (such an index serves equality as well)."""
    method, columns, predicate = re.match(r"^(?:UNIQUE )?(\w+) \((.*?)\)(?: WHERE (.*))?$", definition).groups()
    keys = [re.sub(r" (varchar|text)_pattern_ops\b", "", c.strip()) for c in columns.split(",")]
    return method, keys, predicate or ""


@pytest.mark.parametrize("model", list(EXPECTED), ids=lambda model: model.__name__)
def test_no_index_is_a_left_prefix_of_another(model):
    """A plain index whose columns lead another index of the same predicate (or are its
    columns) answers no query that one cannot; a unique one enforces its constraint."""
    indexes = _indexes(model._meta.db_table)
    for name, definition in indexes.items():
        if definition.startswith("UNIQUE"):
            continue
        method, columns, predicate = _parts(definition)
        for other, other_definition in indexes.items():
            other_method, other_columns, other_predicate = _parts(other_definition)
            if other != name and (other_method, other_predicate) == (method, predicate):
                assert other_columns[: len(columns)] != columns, (name, other)


# Plain index scans are priced out with sequential ones: on these tables of a few rows (or
# none) the planner may as well walk another index filtering every row (a walk of the
# created_at index found mem0's messages of a session once autovacuum had analysed the
# table), a coin toss of equal costs. A bitmap scan needs an index condition, so what
# remains reads each table through its condition's index, or shows a Seq Scan.
BY_CONDITION = ("seqscan", "indexscan")


def _plan(queryset) -> str:
    """EXPLAIN with sequential and plain index scans priced out: the rows the query asks
    for, through the indexes that find them."""
    with transaction.atomic(), connection.cursor() as cursor:
        for node in BY_CONDITION:
            cursor.execute(f"SET LOCAL enable_{node} = off")
        return queryset.explain()


def test_lookups_by_request_and_user_id_still_read_an_index(alice):
    request_id = str(uuid.uuid4())
    # The audit admin's search by a UUID: the call's rows or the rows naming the memory.
    plan = _plan(AuditEvent.objects.filter(Q(request_id=request_id) | Q(memory_ids__contains=[request_id])))
    assert "audit_request" in plan and "audit_memory_ids" in plan and "Seq Scan" not in plan, plan
    # A turn's lifecycle and erasure's account deletion: one call's audit rows.
    plan = _plan(AuditEvent.objects.filter(request_id=request_id))
    assert f"Index Cond: ((request_id)::text = '{request_id}'::text)" in plan and "audit_request" in plan, plan
    # Ingest's reconcile and the history admin's search: one call's versions.
    plan = _plan(MemoryHistory.objects.filter(request_id=request_id))
    assert f"Index Cond: ((request_id)::text = '{request_id}'::text)" in plan and "history_request" in plan, plan
    # The usage admin's search and the user's usage page (memories.selectors.usage_by_day).
    plan = _plan(UsageEvent.objects.filter(user_id=str(alice.pk)))
    assert f"Index Cond: ((user_id)::text = '{alice.pk}'::text)" in plan and "usage_event_user_created" in plan, plan
    # A user's chat turns (their erasure, ON DELETE CASCADE) and one call's turn.
    plan = _plan(ProxyTurn.objects.filter(user_id=alice.pk))
    assert f"Index Cond: (user_id = {alice.pk})" in plan and "Seq Scan" not in plan, plan
    plan = _plan(ProxyTurn.objects.filter(request_id=request_id))
    assert "proxy_proxyturn_request_id_key" in plan and "Seq Scan" not in plan, plan
    # The proxy's attempts of a turn: their ingest intents, by request id.
    plan = _plan(IngestIntent.objects.filter(request_id__in=[request_id, str(uuid.uuid4())]))
    assert "ingest_intent_request_unique" in plan and "Seq Scan" not in plan, plan
    # mem0's last turns of a session (and their trim), and a user's raw-message purge.
    scope = f"user_id=default:{alice.pk}&agent_id=a"
    plan = _plan(EngineMessage.objects.filter(session_scope=scope).order_by("-created_at", "-id")[:10])
    assert f"Index Cond: ((session_scope)::text = '{scope}'::text)" in plan and "engine_message_scope" in plan, plan
    plan = _plan(EngineMessage.objects.filter(user_id=f"default:{alice.pk}"))
    assert f"Index Cond: ((user_id)::text = 'default:{alice.pk}'::text)" in plan, plan
    assert "engine_message_user" in plan, plan


def _sql_plan(query, *, priced_out: tuple[str, ...] = ("seqscan", "sort"), without: tuple[str, ...] = ()) -> str:
    """EXPLAIN of a queryset, or of a query as Django ran it, with these plan nodes priced
    out (by default: a Sort then shows only where no index gives the order) and these
    indexes dropped, in a transaction rolled back."""
    with transaction.atomic(), connection.cursor() as cursor:
        for index in without:  # a constraint's index goes with its constraint
            cursor.execute(
                "SELECT conrelid::regclass::text, conname FROM pg_constraint WHERE conindid = %s::regclass", [index]
            )
            owner = cursor.fetchone()
            cursor.execute(
                f'ALTER TABLE "{owner[0]}" DROP CONSTRAINT "{owner[1]}"' if owner else f'DROP INDEX "{index}"'
            )
        for node in priced_out:
            cursor.execute(f"SET LOCAL enable_{node} = off")
        if isinstance(query, str):
            cursor.execute(f"EXPLAIN {query}")
            plan = "\n".join(row[0] for row in cursor.fetchall())
        else:
            plan = query.explain()
        transaction.set_rollback(True)
    return plan


WHOLE_SORT = re.compile(r"^\s*(->\s+)?Sort  \(", re.MULTILINE)  # a Sort node, not an Incremental Sort
# The usage indexes that also serve a time range (or its order) without the user: on a few
# events, walked or skip-scanned testing each row's user, they cost what the user's own
# index does (statistics decided, and autovacuum's chose a skip scan once). Dropped for the
# checks that the user's index serves the range.
USAGE_TIME_INDEXES = ("billing_usageevent_created_at_340b6605", "billing_usa_operati_cc9d10_idx")


def test_a_users_usage_reads_only_their_events_in_its_time_range(alice, admin_client):
    """The usage page (the last 30 days) and the admin's search by user id (newest first,
    or in its date filter's range) read the user's events in that range from the index,
    not every event they ever had (billing 0005)."""
    user = str(alice.pk)
    UsageEvent.objects.create(user_id=user, operation="remember", channel="mcp")
    in_range = (
        rf"Index Cond: \(\(\(user_id\)::text = '{user}'::text\)"
        r" AND \(created_at >= '[^']+'::timestamp with time zone\)"
    )

    with CaptureQueriesContext(connection) as queries:
        assert usage_by_day(MemoryScope.for_user(alice), days=30)[0]["calls"] == 1
    (query,) = [q["sql"] for q in queries.captured_queries if "billing_usageevent" in q["sql"]]
    # The range through an index condition (a bitmap needs one; a walk of the primary key
    # testing each row costs the same on one row), without the time indexes.
    plan = _sql_plan(query, priced_out=BY_CONDITION, without=USAGE_TIME_INDEXES)
    assert "usage_event_user_created" in plan and re.search(in_range, plan), plan

    def admin_plan(params: dict[str, str]) -> str:
        page = admin_client.get("/admin/billing/usageevent/", params)
        assert page.status_code == 200 and len(page.context["cl"].result_list) == 1, params
        changelist = page.context["cl"]
        return _sql_plan(changelist.queryset[: changelist.list_per_page], without=USAGE_TIME_INDEXES)

    # Newest first: the user's index read backwards, only rows of one instant left to sort.
    plan = admin_plan({"q": user})
    assert "Index Scan Backward using usage_event_user_created" in plan, plan
    assert f"Index Cond: ((user_id)::text = '{user}'::text)" in plan and not WHOLE_SORT.search(plan), plan
    # With the date filter ("Today", as its link asks): its range, from the index too.
    today = timezone.localtime().replace(hour=0, minute=0, second=0, microsecond=0)
    since = {"created_at__gte": str(today), "created_at__lt": str(today + timedelta(days=1))}
    plan = admin_plan({"q": user, **since})
    assert "usage_event_user_created" in plan and re.search(in_range, plan), plan
    assert "created_at < " in plan.split("Index Cond:")[1].split("\n")[0] and not WHOLE_SORT.search(plan), plan


def test_a_chat_call_still_has_at_most_one_turn(alice):
    def turn():
        return ProxyTurn.objects.create(request_id="req-1", user=alice, tenant="default", session_id="s")

    turn()
    with pytest.raises(IntegrityError), transaction.atomic():
        turn()
    assert ProxyTurn.objects.filter(request_id="req-1").count() == 1


def test_an_ingest_call_still_has_at_most_one_intent(alice):
    def intent():
        return IngestIntent.objects.create(request_id="req-1", engine_user_id=f"default:{alice.pk}", scope={}, call={})

    intent()
    with pytest.raises(IntegrityError, match="ingest_intent_request_unique"), transaction.atomic():
        intent()
    assert IngestIntent.objects.filter(request_id="req-1").count() == 1
    with connection.cursor() as cursor:  # the constraint kept its index's new name
        cursor.execute(
            "SELECT conname FROM pg_constraint WHERE conrelid = 'memories_ingestintent'::regclass AND contype = 'u'"
        )
        assert cursor.fetchall() == [("ingest_intent_request_unique",)]


@pytest.mark.django_db(transaction=True)
def test_the_migrations_keep_the_plain_indexes_both_ways():
    """Back: the twins return beside the indexes under their old names. Forward again: the
    twins go, the indexes are renamed, or built where a database lacked one."""
    executor = MigrationExecutor(connection)
    executor.migrate(
        [("audit", "0022_history_drop_memory_id_indexes"), ("billing", "0003_usageevent_claim_token"),
         ("proxy", "0006_turn_recent_index"), ("memories", "0031_drop_user_prefix_indexes")]
    )  # fmt: skip
    history, usage = _indexes("audit_memoryhistory"), _indexes("billing_usageevent")
    assert history["audit_memoryhistory_request_id_f24d624c"] == "btree (request_id)"
    assert history["audit_memoryhistory_request_id_f24d624c_like"] == "btree (request_id varchar_pattern_ops)"
    assert "history_request" not in history
    assert usage["billing_usageevent_user_id_45fe71e5"] == "btree (user_id)"
    assert usage["billing_usageevent_user_id_45fe71e5_like"] == "btree (user_id varchar_pattern_ops)"
    assert "usage_event_user_created" not in usage
    assert "proxy_proxyturn_request_id_e191a71a_like" in _indexes("proxy_proxyturn")
    assert "audit_auditevent_request_id_b6fdcfa6_like" in _indexes("audit_auditevent")
    messages, intents = _indexes("memories_enginemessage"), _indexes("memories_ingestintent")
    assert messages["memories_enginemessage_user_id_516c23fd"] == "btree (user_id)"
    assert messages["memories_enginemessage_user_id_516c23fd_like"] == "btree (user_id varchar_pattern_ops)"
    assert messages["memories_enginemessage_session_scope_9e490e1a_like"] == "btree (session_scope varchar_pattern_ops)"
    assert intents["memories_ingestintent_request_id_key"] == "UNIQUE btree (request_id)"
    assert intents["memories_ingestintent_request_id_ad931178_like"] == "btree (request_id varchar_pattern_ops)"
    assert not {"engine_message_scope", "engine_message_user", "ingest_intent_request_unique"} & {*messages, *intents}
    with connection.cursor() as cursor:
        cursor.execute("DROP INDEX audit_auditevent_request_id_b6fdcfa6")
        cursor.execute("DROP INDEX memories_enginemessage_session_scope_9e490e1a")

    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())
    for model, expected in EXPECTED.items():
        assert _indexes(model._meta.db_table) == expected, model.__name__


@pytest.mark.django_db(transaction=True)
def test_the_prune_indexes_migrate_back_and_forward():
    """Back: the sliding-window calls lose (at) and have their user index again, failed
    sign-ins lose (at), decisions lose (expires_at). Forward again: as they are now."""
    executor = MigrationExecutor(connection)
    executor.migrate(
        [("memories", "0036_ingest_intent_open_created_drop_message_created_at"),
         ("audit", "0023_request_id_plain_indexes"), ("toolkit", "0005_drop_user_prefix_indexes")]
    )  # fmt: skip
    events = _indexes("memories_rateevent")
    assert events["memories_rateevent_user_id_91a3b14e"] == "btree (user_id)" and "rate_event_at" not in events
    assert "login_failure_at" not in _indexes("audit_loginfailure")
    assert "decision_expires" not in _indexes("toolkit_decision")

    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())
    for model in (RateEvent, LoginFailure):
        assert _indexes(model._meta.db_table) == EXPECTED[model], model.__name__
    assert _indexes("toolkit_decision")["decision_expires"] == "btree (expires_at) WHERE (expires_at IS NOT NULL)"


def _intent_queries(captured, verb: str) -> list[str]:
    return [q["sql"] for q in captured if q["sql"].startswith(verb) and '"memories_ingestintent"' in q["sql"]]


def test_a_users_intents_are_read_from_their_indexes_not_the_whole_table(alice_scope, monkeypatch):
    """An erasure and a clear-all mark the user's open intents, the clear-all's undo unmarks
    them, the erasure deletes the closed ones, and the prune deletes every user's old closed
    ones: each from an index of just those rows, in the order asked (memories 0033)."""
    from memories import services
    from memories.services import _ingest_intents_unsupersede, ingest_intents_supersede
    from memories.toolkit.services import toolkit_user_data_wipe
    from tests.conftest import internal_call

    def intent(request_id: str, state: str) -> None:
        closed_at = timezone.now() - timedelta(days=30) if state != IngestIntent.State.OPEN else None
        IngestIntent.objects.create(
            request_id=request_id, engine_user_id=alice_scope.engine_user_id, scope={}, call={}, state=state,
            closed_at=closed_at,
        )  # fmt: skip

    intent("open", IngestIntent.State.OPEN)
    intent("done", IngestIntent.State.DONE)
    users_rows = f"Index Cond: ((engine_user_id)::text = '{alice_scope.engine_user_id}'::text)"

    with CaptureQueriesContext(connection) as supersede:
        assert ingest_intents_supersede(alice_scope, call=internal_call(), erased=False) == 1
    with CaptureQueriesContext(connection) as unsupersede:
        _ingest_intents_unsupersede(alice_scope, request_id="other")
    # In pk order from the user's open rows: the primary key walked testing every row's
    # user and state gives that order too, at a few rows' equal cost; it is dropped for the
    # check. The erasure's delete through an index condition (a bitmap needs one): the
    # closed rows' other index, scanned whole for its predicate, costs the same on a few
    # rows; it is dropped for that check.
    for captured in (supersede, unsupersede):
        (query,) = _intent_queries(captured.captured_queries, "SELECT")
        plan = _sql_plan(query, without=("memories_ingestintent_pkey",))
        assert "ingest_intent_user_open" in plan and users_rows in plan and not WHOLE_SORT.search(plan), plan

    with CaptureQueriesContext(connection) as erasure:
        toolkit_user_data_wipe(alice_scope, confirm=True, call=internal_call())
    (query,) = _intent_queries(erasure.captured_queries, "DELETE")
    plan = _sql_plan(query, priced_out=BY_CONDITION, without=("ingest_intent_closed_at",))
    assert "ingest_intent_user_closed" in plan and users_rows in plan and "Seq Scan" not in plan, plan

    intent("done-again", IngestIntent.State.UNDONE)
    monkeypatch.setattr(services, "INGEST_INTENT_PRUNE_BATCH", 10)
    with CaptureQueriesContext(connection) as prune:
        assert services.ingest_intents_prune() == 1
    batch = _intent_queries(prune.captured_queries, "SELECT")[0]
    plan = _sql_plan(batch)
    assert "ingest_intent_closed_at" in plan and "Index Cond: (closed_at < " in plan, plan
    assert "Seq Scan" not in plan and not WHOLE_SORT.search(plan), plan


@pytest.fixture
def intents_analysed(alice_scope):
    """2,000 closed intents and 20 open ones (calls in flight), analysed: planned as a
    table most of whose rows the reconciler and the gauge must not read."""
    now = timezone.now()
    IngestIntent.objects.bulk_create(
        IngestIntent(
            request_id=f"r-{n}",
            engine_user_id=alice_scope.engine_user_id,
            scope={},
            call={},
            state=IngestIntent.State.OPEN if n < 20 else (IngestIntent.State.DONE, IngestIntent.State.UNDONE)[n % 2],
            created_at=now - timedelta(minutes=n),
            closed_at=None if n < 20 else now - timedelta(minutes=n - 1),
        )
        for n in range(2020)
    )
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {IngestIntent._meta.db_table}")


def test_every_users_open_intents_are_read_from_the_open_rows_index(intents_analysed):
    """The reconciler (open ones past the lease) and the /metrics gauge (how many are open,
    the oldest one's age) read the partial index of the open rows (memories 0036), never
    the closed ones, which are most of the table."""
    from memories.services import ingest_intents_reconcile
    from memsite.observability import DatabaseCollector

    with CaptureQueriesContext(connection) as reconcile:
        # A lease longer than any intent's age: the query runs, nothing is closed.
        assert ingest_intents_reconcile(older_than_s=86400.0) == {"completed": 0, "undone": 0}
    (query,) = _intent_queries(reconcile.captured_queries, "SELECT")
    # The open rows past the lease, sorted by pk. Decided without statistics (the table's
    # are the test's own, which an autovacuum may replace mid-test): the primary key's
    # walk (its order) and the user's open-rows index (the same partial rows, whole) are
    # priced out or dropped, so only an index condition on created_at is left.
    plan = _sql_plan(query, priced_out=BY_CONDITION, without=("ingest_intent_user_open",))
    assert "ingest_intent_open_created" in plan and "Index Cond: (created_at < " in plan, plan
    assert "Seq Scan" not in plan, plan

    with CaptureQueriesContext(connection) as scrape:
        gauges = {family.name: family.samples[0].value for family in DatabaseCollector()._ingest_intents()}
    assert gauges["memsite_ingest_intents_open"] == 20
    (query,) = [q["sql"] for q in scrape.captured_queries if "memories_ingestintent" in q["sql"]]
    plan = _sql_plan(query, priced_out=BY_CONDITION, without=("ingest_intent_user_open",))
    assert "ingest_intent_open_created" in plan and "Seq Scan" not in plan, plan


@pytest.fixture
def turns_analysed(alice):
    """2,000 extracted chat turns, 20 pending and 20 given up, analysed: planned as a table
    most of whose rows the sweep, the gauges and the admin's state filter must not read.
    The oldest 500 extracted ones are past the retention."""
    now = timezone.now()
    retention = timedelta(days=settings.PROXY_TURN_RETENTION_DAYS)

    def state(n: int) -> str:
        return ProxyTurn.State.PENDING if n < 20 else ProxyTurn.State.FAILED if n < 40 else ProxyTurn.State.DONE

    ProxyTurn.objects.bulk_create(
        ProxyTurn(
            request_id=f"turn-{n}", user=alice, tenant="default", session_id="s", state=state(n),
            messages=[{"role": "user", "content": "x"}] if n < 40 else [],
            closed_at=None if n < 20 else now - (retention + timedelta(days=1) if n >= 1540 else timedelta(minutes=n)),
        )
        for n in range(2040)
    )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {ProxyTurn._meta.db_table}")


def _turn_queries(captured, verb: str) -> list[str]:
    return [q["sql"] for q in captured if q["sql"].startswith(verb) and ProxyTurn._meta.db_table in q["sql"]]


def test_pending_and_failed_turns_are_read_from_their_partial_indexes(turns_analysed, admin_client):
    """The sweep (pending turns past their delay, oldest first), the /metrics gauges (how
    many pending, the oldest one's age; how many given up) and the admin's state filter
    read the partial index of those rows (proxy 0008), never the extracted turns."""
    from memsite.observability import DatabaseCollector
    from proxy.services import proxy_turns_sweep

    with CaptureQueriesContext(connection) as sweep:
        assert proxy_turns_sweep(older_than_s=86400.0) == 0  # none that old: the query runs only
    (query,) = _turn_queries(sweep.captured_queries, "SELECT")
    # Without statistics deciding (see the intents' test): the one other index giving the
    # order, every turn's, is dropped; sorting is priced out.
    plan = _sql_plan(query, without=("proxy_turn_recent",))
    assert "proxy_turn_pending" in plan and "Index Cond: (created_at < " in plan, plan
    assert "Seq Scan" not in plan and not WHOLE_SORT.search(plan), plan

    with CaptureQueriesContext(connection) as scrape:
        gauges = {family.name: family.samples[0].value for family in DatabaseCollector()._proxy_turns()}
    assert (gauges["memsite_proxy_turns_pending"], gauges["memsite_proxy_turns_failed"]) == (20, 20)
    pending, failed = _turn_queries(scrape.captured_queries, "SELECT")
    for query, index in ((pending, "proxy_turn_pending"), (failed, "proxy_turn_failed")):
        # Every turn's index, and the closed turns' (a failed turn is one), dropped.
        plan = _sql_plan(query, priced_out=BY_CONDITION, without=("proxy_turn_recent", "proxy_turn_closed_at"))
        assert index in plan and "Seq Scan" not in plan, plan

    for state, index in (("pending", "proxy_turn_pending"), ("failed", "proxy_turn_failed")):
        page = admin_client.get("/admin/proxy/proxyturn/", {"state__exact": state})
        assert page.status_code == 200
        changelist = page.context["cl"]
        assert {turn.state for turn in changelist.result_list} == {state}
        plan = _sql_plan(changelist.queryset[: changelist.list_per_page], without=("proxy_turn_recent",))
        assert f"Index Scan using {index}" in plan and "Seq Scan" not in plan and not WHOLE_SORT.search(plan), plan


def test_the_turn_prune_reads_closed_turns_by_close_time(turns_analysed, monkeypatch):
    """Each batch of the prune reads the oldest closed turns from proxy_turn_closed_at (proxy
    0008), not the primary key from the start through pending and recent turns."""
    from proxy import services

    monkeypatch.setattr(services, "PRUNE_BATCH", 200)
    with CaptureQueriesContext(connection) as prune:
        assert services.proxy_turns_prune() == 500
    assert ProxyTurn.objects.filter(state=ProxyTurn.State.PENDING).count() == 20
    batch = _turn_queries(prune.captured_queries, "SELECT")[0]
    plan = _sql_plan(batch)
    assert "proxy_turn_closed_at" in plan and "Index Cond: (closed_at < " in plan, plan
    assert "Seq Scan" not in plan and not WHOLE_SORT.search(plan), plan
