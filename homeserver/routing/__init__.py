"""Who writes what in a deployment of several processes, and how a write reaches its writer.

``layout`` answers from the config which process writes each stream, owns each
room and sends to each destination; ``internal_api`` is the authenticated HTTP
API processes use to ask each other for writes; ``writers`` and ``forwarding``
are the local and remote implementations of every single-writer operation,
chosen once by the composition root (``homeserver/app.py``); ``federation``
carries outbound federation between the processes that cause it and the
processes that send it. A single process uses only the local implementations.
"""
