"""Matrix logic behind the APIs: accounts and auth, devices, profiles, account data, events and rooms.

Handlers take their stores and collaborators in ``__init__`` (built by
homeserver/app.py), raise ``MatrixError`` for anything a client did wrong, and
never touch SQL or HTTP requests directly.
"""
