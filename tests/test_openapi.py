import pytest

pytestmark = pytest.mark.django_db


def test_schema_lists_the_seven_operations_and_export_import(client):
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
        "export_memories", "import_memories",
        # issue 13: seed 001's prefetch
        "v1_memory_prefetch",
    }  # fmt: skip
    assert schema["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    remember = schema["paths"]["/v1/memories"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert remember["$ref"].endswith("/RememberInput")


def _schema(client) -> dict:
    return client.get("/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()


def test_every_operation_documents_its_errors_and_typed_bodies(client):
    schema = _schema(client)
    error_ref = "#/components/schemas/ErrorResponse"
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            expected = {"400", "401", "409", "413", "421", "429", "503"} | ({"404"} if "{memory_id}" in path else set())
            assert expected <= set(responses), (path, method, sorted(responses))
            for status, response in responses.items():
                if (path, status) == ("/v1/memories/export", "200"):  # a file download, not JSON
                    assert set(response["content"]) == {"application/x-ndjson", "text/markdown"}
                    continue
                body = response["content"]["application/json"]["schema"]
                if status.startswith(("4", "5")):
                    assert body == {"$ref": error_ref}, (path, method, status)
                else:  # typed, not a free-form object
                    assert "$ref" in body, (path, method, status, body)
    error = schema["components"]["schemas"]["ErrorInfo"]
    assert set(error["required"]) == {"code", "message"}
    codes = schema["components"]["schemas"]["ErrorCode"]["enum"]
    assert {"invalid_argument", "payload_too_large", "not_found", "rate_limited", "backend_unavailable"} <= set(codes)


def test_ids_filters_and_metadata_keys_are_described_as_the_validator_checks_them(client):
    import re

    from memories.schemas import KEY_PATTERN, METADATA_KEY_MAX_CHARS, METADATA_MAX_KEYS

    schema = _schema(client)
    item = schema["paths"]["/v1/memories/{memory_id}"]
    for method in ("patch", "delete"):
        (memory_id,) = [p for p in item[method]["parameters"] if p["name"] == "memory_id"]
        assert memory_id["in"] == "path" and memory_id["schema"]["format"] == "uuid"
    parameters = {p["name"]: p for p in schema["paths"]["/v1/memories"]["get"]["parameters"]}
    filters = parameters["filters"]["schema"]
    assert filters["type"] == "string" and filters["contentMediaType"] == "application/json"
    assert filters["contentSchema"]["type"] == "object"
    assert parameters["page_size"]["schema"] == {"type": "integer", "minimum": 1, "maximum": 200}
    metadata = schema["components"]["schemas"]["RememberInput"]["properties"]["metadata"]
    (as_object,) = [branch for branch in metadata["anyOf"] if branch.get("type") == "object"]
    names = as_object["propertyNames"]
    assert names["pattern"] == KEY_PATTERN and names["maxLength"] == METADATA_KEY_MAX_CHARS
    assert "user_id" in names["not"]["enum"] and as_object["maxProperties"] == METADATA_MAX_KEYS
    pattern = re.compile(KEY_PATTERN)
    assert pattern.fullmatch("project.v2-x_y") and not pattern.fullmatch("a__b") and not pattern.fullmatch("_a")


def test_schema_documents_the_seed_001_shape(client):
    schema = _schema(client)
    assert {"/v1/memory", "/v1/memory/search", "/v1/memory/{memory_id}", "/v1/memory/{memory_id}/forget"} <= set(
        schema["paths"]
    )
    store = schema["paths"]["/v1/memory"]["post"]["requestBody"]["content"]["application/json"]
    assert "scope" in schema["components"]["schemas"]["MemoryStore"]["properties"]
    assert store["examples"]


def test_the_patch_body_names_every_field_update_memory_takes_with_its_bounds(client):
    # It listed only memory, pinned and metadata, and said (additionalProperties: false) that
    # nothing else may be sent: a client generated from it could not set tags, importance,
    # memory_type, agent_id, session_id, expires_at, ttl_days, source or why_stored.
    from memories.schemas import TAGS_MAX, TTL_DAYS_MAX, UpdateInput

    schema = _schema(client)
    body_ref = schema["paths"]["/v1/memories/{memory_id}"]["patch"]["requestBody"]["content"]["application/json"]
    body = schema["components"]["schemas"][body_ref["schema"]["$ref"].rsplit("/", 1)[1]]
    expected = {
        "memory", "pinned", "metadata", "memory_type", "tags", "importance", "agent_id", "session_id",
        "expires_at", "ttl_days", "source", "why_stored",
    }  # fmt: skip
    assert set(body["properties"]) == expected == set(UpdateInput.model_fields) - {"memory_id"}
    assert body["additionalProperties"] is False and body["minProperties"] == 1

    def branch(name: str) -> dict:
        (value,) = [b for b in body["properties"][name]["anyOf"] if b.get("type") != "null"]
        return value

    assert branch("memory_type")["enum"] == ["user", "feedback", "project", "reference"]
    assert branch("tags")["maxItems"] == TAGS_MAX and branch("tags")["items"]["type"] == "string"
    assert (branch("importance")["minimum"], branch("importance")["maximum"]) == (0, 1)
    assert branch("ttl_days") == {"type": "integer", "minimum": 1, "maximum": TTL_DAYS_MAX}
    assert branch("agent_id")["pattern"] == branch("session_id")["pattern"] == "^[A-Za-z0-9_.:@-]+$"
    assert branch("pinned") == {"type": "boolean"}
    assert branch("memory")["maxLength"] == 8000
