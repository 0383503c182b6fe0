import pytest
from django.db import connection

pytestmark = pytest.mark.django_db(transaction=True)


def test_healthy(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["database"] == "ok"
    assert body["engine"] == "ok"


def test_engine_failure_is_named(client, settings):
    settings.MEMORY_COLLECTION = "no_such_table"
    response = client.get("/healthz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable"
    assert body["failing"] == ["engine"]
    assert "no_such_table" in body["errors"]["engine"]


def test_embedding_dimension_mismatch_is_named(client, settings):
    settings.EMBEDDING_DIMS = 1536
    response = client.get("/healthz")
    assert response.status_code == 503
    assert "384-d vectors" in response.json()["errors"]["engine"]


def test_database_failure_is_named(client):
    real_name = connection.settings_dict["NAME"]
    connection.close()
    connection.close_pool()
    connection.settings_dict["NAME"] = "memsite_database_that_does_not_exist"
    try:
        response = client.get("/healthz")
    finally:
        connection.close()
        connection.close_pool()
        connection.settings_dict["NAME"] = real_name
    assert response.status_code == 503
    assert response.json()["failing"] == ["database"]


def test_post_is_not_allowed(client):
    assert client.post("/healthz").status_code == 405
