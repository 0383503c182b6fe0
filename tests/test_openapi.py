import pytest

pytestmark = pytest.mark.django_db


def test_schema_lists_the_seven_operations(client):
    response = client.get("/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    schema = response.json()
    operation_ids = {op["operationId"] for path in schema["paths"].values() for op in path.values()}
    assert operation_ids == {
        "search_memory", "remember", "ingest", "update_memory", "delete_memory", "list_memory", "clear_all_memory",
        # issue 11: bulk forget, the trash, seed 001's /v1/memory
        "forget_memories", "list_trash", "restore_memory", "purge_memory",
        "v1_memory_store", "v1_memory_list", "v1_memory_search", "v1_memory_update", "v1_memory_delete",
        "v1_memory_forget",
    }  # fmt: skip
    assert schema["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    remember = schema["paths"]["/v1/memories"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert remember["$ref"].endswith("/RememberInput")


def test_schema_documents_the_seed_001_shape(client):
    schema = client.get("/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    assert {"/v1/memory", "/v1/memory/search", "/v1/memory/{memory_id}", "/v1/memory/{memory_id}/forget"} <= set(
        schema["paths"]
    )
    store = schema["paths"]["/v1/memory"]["post"]["requestBody"]["content"]["application/json"]
    assert "scope" in schema["components"]["schemas"]["MemoryStore"]["properties"]
    assert store["examples"]
