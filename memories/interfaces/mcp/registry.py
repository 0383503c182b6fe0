"""Every MCP toolset this site serves; memsite/asgi.py routes each one's path."""

from __future__ import annotations

from memories.interfaces.mcp.memory import MEMORY_TOOLSET
from memories.interfaces.mcp.toolkit import TOOLKIT_TOOLSET
from memories.interfaces.mcp.toolset import Toolset

TOOLSETS: tuple[Toolset, ...] = (MEMORY_TOOLSET, TOOLKIT_TOOLSET)
