import pytest

pytestmark = pytest.mark.django_db


def test_schema_lists_the_seven_operations_and_export_import(client):
    response = client.get("/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    schema = response.json()
    operation_ids = {op["operationId"] for path in schema["paths"].values() for op in path.values()}
    assert operation_ids == {
        "search_memory", "remember", "ingest", "update_memory", "delete_memory", "list_memory", "clear_all_memory",
        "export_memories", "import_memories",
    }  # fmt: skip
    assert schema["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    remember = schema["paths"]["/v1/memories"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert remember["$ref"].endswith("/RememberInput")
