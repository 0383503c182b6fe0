"""A web page requested with a Host not in ALLOWED_HOSTS (scanners do it all day) was
logged by Django as an ERROR with a whole traceback and the header's text; it is one
WARNING line now, without a traceback and without anything the client wrote."""

from __future__ import annotations

import logging

import pytest

pytestmark = pytest.mark.django_db


def test_a_foreign_host_on_a_web_page_is_one_warning_line(client, caplog):
    with caplog.at_level(logging.INFO):
        response = client.get("/memories/", HTTP_HOST="scanner-probe.example")
    assert response.status_code == 400
    records = [r for r in caplog.records if r.name == "django.security.DisallowedHost"]
    assert len(records) == 1, caplog.text
    (record,) = records
    assert (record.levelname, record.exc_info) == ("WARNING", None)
    assert "ALLOWED_HOSTS" in record.getMessage()
    assert "scanner-probe" not in caplog.text
