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
    # Taking all of a user's memories out, or bringing a file of them in: one billed call each.
    EXPORT_MEMORIES = "export_memories"
    IMPORT_MEMORIES = "import_memories"
    # A person opening one memory in the web UI: audited, not billed.
    GET_MEMORY = "get_memory"
    # The trash (issue 11): a person restores or deletes forever; the purge job too.
    RESTORE_MEMORY = "restore_memory"
    PURGE_MEMORY = "purge_memory"
    # Background jobs: trash past retention and expired memories deleted for good.
    PURGE_DUE = "purge_due"
    # Staff actions in the admin.
    ADMIN_VIEW_MEMORY = "admin_view_memory"
    # A list page that shows memory text (memories, memory history): the ids it showed.
    ADMIN_LIST_CONTENT = "admin_list_content"
    ADMIN_REVOKE_API_KEY = "admin_revoke_api_key"
    # A bearer API key issued (the web UI, manage.py issue_api_key): who got which powers.
    API_KEY_ISSUE = "api_key_issue"
    # A bearer API key revoked by its owner (web UI, manage.py revoke_api_key); staff: ADMIN_REVOKE_API_KEY.
    API_KEY_REVOKE = "api_key_revoke"
    ADMIN_RETRY_USAGE_EVENTS = "admin_retry_usage_events"
    # Chat turns whose memory extraction was given up, put back in the queue by staff.
    ADMIN_REQUEUE_PROXY_TURNS = "admin_requeue_proxy_turns"
    # A request without a valid credential (sampled: the first per ip per minute).
    AUTHENTICATE = "authenticate"
    # The agent turn lifecycle (issue 13, seed 002) and seed 001's prefetch.
    MEMORY_BEFORE_TURN = "memory_before_turn"
    MEMORY_AFTER_TURN = "memory_after_turn"
    MEMORY_RUN_MAINTENANCE = "memory_run_maintenance"
    MEMORY_LIST_DIR_WITH_ABSTRACT = "memory_list_dir_with_abstract"
    MEMORY_RUN_TURN = "memory_run_turn"
    MEMORY_PREFETCH = "memory_prefetch"
    DELETE_SESSION_EVENTS = "delete_session_events"
    # The chat proxy (issue 15): one billed call per answered chat completion.
    CHAT_COMPLETION = "chat_completion"
    # A chat proxy key's upstream configuration saved or deleted (owner or staff).
    PROXY_TOKEN_CONFIG = "proxy_token_config"  # noqa: S105 - an operation name
    # Issue 14: seed 003's toolkit (/engines/memory-toolkit/mcp; its delete_memory is DELETE_MEMORY).
    STORE_MEMORY = "store_memory"
    RECALL_MEMORY = "recall_memory"
    HYBRID_SEARCH = "hybrid_search"
    CHECK_CACHE = "check_cache"
    STORE_CACHE = "store_cache"
    CACHE_INVALIDATE = "cache_invalidate"
    SEARCH_WEB = "search_web"
    MEMORY_HEALTH = "memory_health"
    WIPE_USER_DATA = "wipe_user_data"
    STORE_DECISION = "store_decision"
    RECALL_DECISION = "recall_decision"
    # Background enrichment of long-term candidates; a person deleting a decision in the UI.
    ENRICH_MEMORY = "enrich_memory"
    DELETE_DECISION = "delete_decision"
    # A person deleting cached answers in the web UI (one, or all of them): audited, not billed.
    DELETE_CACHE_ENTRY = "delete_cache_entry"
    # A person downloading their decisions and cached answers in the web UI: audited, not billed.
    EXPORT_DECISIONS_AND_CACHE = "export_decisions_and_cache"
    # ...and their agent sessions' logs (summaries, raw events, archives).
    EXPORT_SESSION_LOGS = "export_session_logs"
    # Support handling an erasure request in the admin; a user account deleted there (after
    # the same erasure).
    ADMIN_WIPE_USER_DATA = "admin_wipe_user_data"
    ADMIN_DELETE_USER = "admin_delete_user"
    # A user account added or changed (staff, superuser, active, groups, permissions...), or
    # its password set or disabled, by staff in the admin: the names of the fields changed.
    ADMIN_CREATE_USER = "admin_create_user"
    ADMIN_CHANGE_USER = "admin_change_user"
    ADMIN_SET_PASSWORD = "admin_set_password"  # noqa: S105 - an operation name
    # A permission group added, changed (its name, its permissions: what every member may
    # do) or deleted by staff in the admin: the permissions added and removed.
    ADMIN_CREATE_GROUP = "admin_create_group"
    ADMIN_CHANGE_GROUP = "admin_change_group"
    ADMIN_DELETE_GROUP = "admin_delete_group"
    # A tenant added, or its display name changed, by staff in the admin.
    ADMIN_SAVE_TENANT = "admin_save_tenant"
    # An erasure done again after a restore to a point before it (memsite's erasure ledger).
    ERASURE_REAPPLY = "erasure_reapply"
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
    PROXY = "proxy"
    OAUTH = "oauth"


class MemoryType(models.TextChoices):
    """Seed 001's memory types. Stored as plain strings in the engine row."""

    USER = "user"
    FEEDBACK = "feedback"
    PROJECT = "project"
    REFERENCE = "reference"


class Permission(models.TextChoices):
    """What a credential may do (issue 12). Every operation declares the one it needs."""

    READ = "read"
    WRITE = "write"
    DELETE = "delete"


ALL_PERMISSIONS: frozenset[str] = frozenset(Permission.values)


class Role(models.TextChoices):
    """Who a credential may act for (issue 12): itself, any user of its tenant, anyone."""

    USER = "user"
    TENANT_ADMIN = "tenant_admin"
    PLATFORM = "platform"


def permissions_parse(raw: str) -> frozenset[str]:
    """`read,write` -> {"read", "write"}; ValueError names the first unknown one."""
    names = {part.strip().lower() for part in raw.split(",") if part.strip()}
    unknown = sorted(names - ALL_PERMISSIONS)
    if unknown:
        raise ValueError(f"unknown permission {unknown[0][:40]!r} (choose from read, write, delete)")
    if not names:
        raise ValueError("give at least one permission (read, write, delete)")
    return frozenset(names)
