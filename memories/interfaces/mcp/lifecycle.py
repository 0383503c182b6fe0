"""The memory-lifecycle toolset at /engines/memory-lifecycle/mcp (issue 13, seed 002 §4):
server-side turn hooks, so a model that forgets to call memory tools still has memory."""

from __future__ import annotations

from memories.interfaces.mcp.toolset import Toolset

LIFECYCLE_TOOLSET = Toolset(
    id="memory-lifecycle",
    name="memsite-memory-lifecycle",
    instructions=(
        "Server-side memory for an agent loop. Before every model turn call memory_before_turn with the new "
        "input items and send the returned input_items to the model; after the turn call memory_after_turn with "
        "the turn's input and output items and a turn_id unique in the session (retries are safe; on "
        "resource_busy retry shortly). memory_run_maintenance compacts and tidies a session; "
        "memory_list_dir_with_abstract shows what is kept. Your memories are chosen by your credentials: never "
        "send a user_id."
    ),
    operations=(
        "memory_before_turn",
        "memory_after_turn",
        "memory_run_maintenance",
        "memory_list_dir_with_abstract",
        "memory_run_turn",
    ),
)
