"""The shared kernel: what every layer of Tributary uses, and nothing more.

Matrix errors (``errors``), the one way to run work in the background
(``background``), the one backoff policy (``backoff``) and the log context
(``logcontext``). Stream token types live beside it in ``storage.tokens``.

Rule: nothing here imports anything of ours outside this package
(``tests/unit/test_layers.py`` checks it). It lives under ``storage/`` only
because the repository's top level is fixed and storage is the bottom layer;
it is its own layer, below storage, replication and everything else.
"""
