from io import StringIO

import pytest
from django.core.management import call_command


def test_system_checks_pass():
    call_command("check", stdout=StringIO())


@pytest.mark.django_db
def test_no_missing_migrations():
    call_command("makemigrations", "--check", "--dry-run", stdout=StringIO())
