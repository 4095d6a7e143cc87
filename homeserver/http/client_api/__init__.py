"""Client-server API servlets, one module an area; each is a class of declared routes
(homeserver/http/routes.py) given the few handlers it calls, and ``app.py`` declares them
all in the order the router matches them. Each path is served under both
``/_matrix/client/r0`` and ``/_matrix/client/v3``. docs/client-api.md lists them.
"""
