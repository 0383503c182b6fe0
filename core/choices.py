"""The names every part of the system agrees on: operations and channels.

Audit rows, usage events, rate-limit settings, turn events and admin filters all use
these values; they are stored as plain strings, so a value never changes once used."""

from __future__ import annotations

from django.db import models


class Operation(models.TextChoices):
    # The seven memory tools (MCP and REST), billed and rate limited.
    SEARCH_MEMORY = "search_memory"
    REMEMBER = "remember"
    INGEST = "ingest"
    UPDATE_MEMORY = "update_memory"
    DELETE_MEMORY = "delete_memory"
    LIST_MEMORY = "list_memory"
    CLEAR_ALL_MEMORY = "clear_all_memory"
    # A person opening one memory in the web UI: audited, not billed.
    GET_MEMORY = "get_memory"
    # The trash (issue 11): a person restores or deletes forever; the purge job too.
    RESTORE_MEMORY = "restore_memory"
    PURGE_MEMORY = "purge_memory"
    # Background jobs: trash past retention and expired memories deleted for good.
    PURGE_DUE = "purge_due"
    # Staff actions in the admin.
    ADMIN_VIEW_MEMORY = "admin_view_memory"
    ADMIN_REVOKE_API_KEY = "admin_revoke_api_key"
    ADMIN_RETRY_USAGE_EVENTS = "admin_retry_usage_events"
    # A request without a valid credential (sampled: the first per ip per minute).
    AUTHENTICATE = "authenticate"
    # MCP authorization (issue 16): client registration, consent, token issue, revocation.
    OAUTH_CLIENT_REGISTER = "oauth_client_register"
    OAUTH_CONSENT = "oauth_consent"
    OAUTH_TOKEN = "oauth_token"  # noqa: S105 - an operation name
    OAUTH_REVOKE = "oauth_revoke"


MEMORY_TOOL_OPERATIONS: tuple[Operation, ...] = (
    Operation.SEARCH_MEMORY,
    Operation.REMEMBER,
    Operation.INGEST,
    Operation.UPDATE_MEMORY,
    Operation.DELETE_MEMORY,
    Operation.LIST_MEMORY,
    Operation.CLEAR_ALL_MEMORY,
)


class Channel(models.TextChoices):
    MCP = "mcp"
    REST = "rest"
    UI = "ui"
    ADMIN = "admin"
    INTERNAL = "internal"
    OAUTH = "oauth"


class MemoryType(models.TextChoices):
    """Seed 001's memory types. Stored as plain strings in the engine row."""

    USER = "user"
    FEEDBACK = "feedback"
    PROJECT = "project"
    REFERENCE = "reference"
