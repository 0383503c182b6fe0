"""Every MCP toolset this site serves; memsite/asgi.py routes each one's path."""

from __future__ import annotations

from django.conf import settings

from memories.interfaces.mcp.memory import MEMORY_TOOLSET
from memories.interfaces.mcp.toolkit import TOOLKIT_TOOLSET
from memories.interfaces.mcp.toolset import Toolset

TOOLSETS: tuple[Toolset, ...] = (MEMORY_TOOLSET, TOOLKIT_TOOLSET)

# Issue 13: the lifecycle toolset, unless MCP_MEMORY_ENABLED turns it off.
if settings.MCP_MEMORY_ENABLED:
    from memories.interfaces.mcp.lifecycle import LIFECYCLE_TOOLSET

    TOOLSETS = (*TOOLSETS, LIFECYCLE_TOOLSET)
