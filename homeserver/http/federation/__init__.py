"""The server-server API servlets: parse and verify each request, then call the federation logic in homeserver/federation/."""
