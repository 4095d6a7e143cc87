"""Federation logic: what this server does with what other servers send and ask.

``transaction`` handles ``PUT /send``; ``membership`` joins, leaves, knocks and invites
across servers; ``history`` serves events and state; ``keys`` serves our signing keys and
fetches other servers'; ``gaps`` and ``backfill`` fill holes in a room's graph. The servlets
are adapters in homeserver/http/federation/; the outbound client is in homeserver/remote/.
See docs/federation.md.
"""
