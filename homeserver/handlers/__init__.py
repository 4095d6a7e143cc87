"""Domain services behind the APIs, one folder a domain (accounts, rooms, sync, e2e, push, directory, ephemeral).

Handlers take their stores and collaborators in ``__init__`` (built by
homeserver/app.py), raise ``MatrixError`` for anything a client did wrong, and
never touch SQL or HTTP requests directly. A group imports only groups below it
(docs/architecture.md); one that needs a service above receives it as a Protocol.
"""
