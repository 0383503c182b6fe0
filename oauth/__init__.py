"""The authorization server for MCP clients (issue 16): OAuth 2.1 authorization code + PKCE,
client ID metadata documents, dynamic client registration, consent and connected apps."""
