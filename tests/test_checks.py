from io import StringIO

import pytest
from django.core.management import call_command

from billing.checks import usage_delivery_lease_check


def test_system_checks_pass():
    call_command("check", stdout=StringIO())


@pytest.mark.django_db
def test_no_missing_migrations():
    call_command("makemigrations", "--check", "--dry-run", stdout=StringIO())


def test_a_usage_lease_shorter_than_two_posts_stops_the_start(settings):
    settings.USAGE_DELIVERY_TIMEOUT_S = 10
    settings.USAGE_CLAIM_LEASE_S = 20
    (error,) = usage_delivery_lease_check()
    assert error.id == "billing.E001" and "USAGE_CLAIM_LEASE_S (20)" in error.msg
    settings.USAGE_CLAIM_LEASE_S = 21
    assert usage_delivery_lease_check() == []
