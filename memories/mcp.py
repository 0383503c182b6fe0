"""The MCP server at /engines/memory/mcp (official `mcp` SDK, stateless, JSON)."""

from django.conf import settings
from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings

MCP_PATH = "/engines/memory/mcp"

server = MCPServer(
    name="memsite-memory",
    instructions="Personal memory for the authenticated user: remember, recall and curate facts.",
)


def _transport_security() -> TransportSecuritySettings:
    hosts = []
    origins = []
    for host in settings.ALLOWED_HOSTS:
        if host == "*":
            return TransportSecuritySettings(enable_dns_rebinding_protection=False)
        hosts += [host, f"{host}:*"]
        origins += [f"http://{host}", f"http://{host}:*", f"https://{host}", f"https://{host}:*"]
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=hosts,
        allowed_origins=origins + list(settings.CSRF_TRUSTED_ORIGINS),
    )


def build_mcp_app():
    return server.streamable_http_app(
        streamable_http_path=MCP_PATH,
        stateless_http=True,
        json_response=True,
        transport_security=_transport_security(),
    )
