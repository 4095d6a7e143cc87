"""Reaching other servers over HTTPS: the outbound federation client (server discovery, X-Matrix request signing, timeouts, the IP filter), and its metrics."""
