"""Sign-in with a password behind the login throttle: failed attempts per username and per
client address, refused (429) without a password check past either limit, counted and
audited like the API's 401s, the password never shown, stored or logged."""

import logging
import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from audit.models import AuditEvent, AuthFailureWindow, LoginFailure
from audit.services import login_attempt_begin
from core.choices import Channel
from core.errors import ErrorCode, ServiceError
from core.scope import CallContext

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _fast_password_hashes(settings):
    """Dozens of password checks: the throttle does not care how slow the hash is."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


WRONG = "Wr0ng-guess-7731"
REFUSED = b"Too many failed sign-ins."


def _sign_in(client, username: str, password: str, *, ip: str = "127.0.0.1", path: str = "/accounts/login/"):
    return client.post(path, {"username": username, "password": password}, REMOTE_ADDR=ip)


def _signed_in(client) -> bool:
    return client.get("/memories/").status_code == 200


def test_the_eleventh_attempt_is_refused_even_with_the_right_password(client, alice, caplog):
    caplog.set_level(logging.DEBUG)
    for _ in range(10):
        failed = _sign_in(client, "alice", WRONG)
        assert failed.status_code == 200 and b"did not match" in failed.content
        assert WRONG.encode() not in failed.content
    refused = _sign_in(client, "alice", "alice-password-1")
    assert refused.status_code == 429
    assert REFUSED in refused.content and b"Try again in 15 minutes" in refused.content
    assert 600 < int(refused["Retry-After"]) <= 900  # when the first failure ages out
    assert b"alice-password-1" not in refused.content and b"did not match" not in refused.content
    assert not _signed_in(client)
    for record in caplog.records:  # neither password reaches a log line
        assert WRONG not in record.getMessage() and "alice-password-1" not in record.getMessage()


def test_an_unknown_username_is_answered_the_same(client, alice):
    answers = {}
    for username in ("alice", "nobody-here"):
        for _ in range(10):
            assert b"did not match" in _sign_in(client, username, WRONG).content
        refused = _sign_in(client, username, WRONG)
        answers[username] = (refused.status_code, refused["Retry-After"], REFUSED in refused.content)
    assert answers["alice"][0] == answers["nobody-here"][0] == 429
    assert answers["alice"][2] and answers["nobody-here"][2]


def test_another_username_and_another_address_are_unaffected(client, alice, bob):
    for _ in range(10):
        _sign_in(client, "alice", WRONG)
    assert _sign_in(client, "Alice", WRONG).status_code == 429  # one limit for every spelling
    assert _sign_in(client, "bob", "bob-password-1").status_code == 302  # same address, other user
    client.logout()
    # The username's limit holds from any address.
    assert _sign_in(client, "alice", "alice-password-1", ip="198.51.100.4").status_code == 429


def test_the_address_limit_covers_every_username_from_it(client, alice, bob, settings):
    settings.LOGIN_FAILURES_PER_ADDRESS = 4
    for username in ("carol", "dave", "erin", "alice"):
        assert _sign_in(client, username, WRONG, ip="2001:db8::1").status_code == 200
    # The same /64 is the same client; another /64 or an IPv4 address is not.
    assert _sign_in(client, "bob", "bob-password-1", ip="2001:db8::ffff").status_code == 429
    assert _sign_in(client, "bob", "bob-password-1", ip="2001:db8:0:1::1").status_code == 302
    client.logout()
    assert _sign_in(client, "bob", "bob-password-1", ip="203.0.113.9").status_code == 302


def test_failures_age_out_of_the_window_and_successes_are_not_failures(client, alice):
    for _ in range(9):
        _sign_in(client, "alice", WRONG)
    assert _sign_in(client, "alice", "alice-password-1").status_code == 302
    client.logout()
    assert LoginFailure.objects.count() == 18  # 9 failures x (username, address); the success left none
    assert _sign_in(client, "alice", WRONG).status_code == 200  # the 10th failure
    assert _sign_in(client, "alice", "alice-password-1").status_code == 429
    LoginFailure.objects.update(at=timezone.now() - timedelta(seconds=901))
    assert _sign_in(client, "alice", "alice-password-1").status_code == 302


def test_failures_are_counted_and_audited_like_401s(client, alice):
    for _ in range(10):
        _sign_in(client, "alice", WRONG)
    _sign_in(client, "alice", "alice-password-1")  # refused
    _sign_in(client, "somebody-else", WRONG)

    windows = list(AuthFailureWindow.objects.all())
    assert sum(w.count for w in windows) == 12
    assert {(w.ip, w.first_channel) for w in windows} == {("127.0.0.1", "ui")}
    rows = AuditEvent.objects.filter(operation="authenticate", channel="ui")
    sampled = rows.filter(detail__sampled__isnull=False).order_by("id").first()
    assert (sampled.outcome, sampled.error_code, sampled.actor_username) == ("denied", "unauthenticated", "alice")
    assert sampled.actor_user_id is None and sampled.subject_user_id is None and sampled.ip == "127.0.0.1"
    throttled = rows.get(detail__has_key="login_throttled")
    assert throttled.detail["login_throttled"] == ["username"] and throttled.actor_username == "alice"

    # The password is nowhere; the username only as an existing account's actor name.
    stored = " ".join(str(row) for row in AuditEvent.objects.values_list("detail", "before", "after", "actor_username"))
    stored += " ".join(LoginFailure.objects.values_list("key", flat=True))
    assert WRONG not in stored and "alice-password-1" not in stored and "somebody-else" not in stored
    assert not LoginFailure.objects.filter(key__icontains="alice").exists()


def test_a_refused_attempt_is_sampled_under_rate_limited(client, alice, settings):
    settings.LOGIN_FAILURES_PER_USERNAME = 1
    _sign_in(client, "alice", WRONG, ip="192.0.2.1")
    _sign_in(client, "alice", WRONG, ip="192.0.2.2")  # refused: the first failure of its address
    sampled = AuditEvent.objects.get(operation="authenticate", ip="192.0.2.2")
    assert (sampled.error_code, sampled.detail["credential_presented"]) == ("rate_limited", True)


def test_the_admin_sign_in_counts_against_the_same_limits(client, django_user_model):
    django_user_model.objects.create_superuser("sam", "sam@example.com", "sam-password-1")
    for _ in range(10):
        assert _sign_in(client, "sam", WRONG, path="/admin/login/").status_code == 200
    refused = _sign_in(client, "sam", "sam-password-1", path="/admin/login/")
    assert REFUSED in refused.content and b"sam-password-1" not in refused.content
    assert client.get("/admin/").status_code == 302  # not signed in
    assert _sign_in(client, "sam", "sam-password-1").status_code == 429  # the web form too
    assert AuditEvent.objects.filter(operation="authenticate", channel="admin").exists()


def test_concurrent_attempts_cannot_overrun_the_limit(alice):
    """Each admitted attempt holds its place from before its password check: 30 at once
    for one username admit exactly 10."""
    admitted, refused, barrier = [], [], threading.Barrier(30)

    def attempt(n: int) -> None:
        try:
            barrier.wait()
            call = CallContext(channel=Channel.UI, ip=f"10.0.{n}.1")
            admitted.append(login_attempt_begin(call=call, username="alice"))
        except ServiceError as error:
            assert error.code == ErrorCode.RATE_LIMITED
            refused.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=attempt, args=(n,)) for n in range(30)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert (len(admitted), len(refused)) == (10, 20)
