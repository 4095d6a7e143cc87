"""Federation: the server-server API, inbound and outbound.

``keys`` serves our signing keys and fetches other servers'; ``auth`` signs and
verifies ``X-Matrix`` requests; ``client`` is the outbound HTTPS client;
``transaction`` handles ``PUT /send``; ``membership`` joins rooms across servers;
``history`` serves events and state; ``servlets`` routes it all; ``sender`` is the
interim outbound path for new local events. See docs/federation.md.
"""
