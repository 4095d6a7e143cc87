"""Server administration: the admin API (``/_synapse/admin/...``, the reference server's
paths and shapes), shared-secret registration, ``tributary register-user`` and the
operator console. docs/admin.md describes it all, and its security model."""
