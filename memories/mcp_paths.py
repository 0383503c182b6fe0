MCP_PATH = "/engines/memory/mcp"
PROTECTED_RESOURCE_PATH = "/.well-known/oauth-protected-resource"
