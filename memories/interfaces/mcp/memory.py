"""The memory toolset at /engines/memory/mcp: the seven memory tools (contracts unchanged)."""

from __future__ import annotations

from core.choices import MEMORY_TOOL_OPERATIONS
from memories.interfaces.mcp.toolset import Toolset

MEMORY_TOOLSET = Toolset(
    id="memory",
    name="memsite-memory",
    instructions=(
        "Personal memory for the authenticated user: remember, recall and curate facts about them. "
        "Call search_memory at the start of a task or whenever earlier context about the user (preferences, "
        "people, projects, past decisions) could help; call remember when the user states a durable fact or "
        "preference worth keeping (one fact per call); use ingest to extract facts from a whole conversation "
        "turn; update_memory or delete_memory when the user corrects or retracts something; list_memory to "
        "review everything. Never store secrets. clear_all_memory only on the user's explicit request."
    ),
    operations=tuple(op.value for op in MEMORY_TOOL_OPERATIONS),
)
