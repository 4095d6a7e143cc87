"""The ``federation_sender`` section of homeserver.yaml, as typed, immutable values.

This package owns the types; ``homeserver/config.py`` stays the one place that
reads the YAML file and parses that section into them (checking ranges and
naming the dotted key path in every error). Defaults here are the defaults an
operator gets with no ``federation_sender`` section at all.
"""

# tests: tests/unit/test_config.py, tests/unit/federation_sender/test_core.py

from __future__ import annotations

from datetime import timedelta

import attrs


@attrs.frozen
class BackoffConfig:
    """``federation_sender.backoff``: how long a failing destination is left alone.

    The first failure waits ``initial``; each further one multiplies the wait by
    ``multiplier`` and a random factor in ``jitter``, up to ``max``.
    """

    initial: timedelta = timedelta(minutes=10)
    multiplier: float = 2.0
    max: timedelta = timedelta(days=7)
    jitter: tuple[float, float] = (0.8, 1.4)


@attrs.frozen
class CatchUpConfig:
    """``federation_sender.catch_up``: sending a destination what it missed."""

    # A destination whose backoff grows past this drops its in-memory queue and catches up.
    threshold: timedelta = timedelta(hours=1)
    rooms_per_batch: int = 50
    # Before each room's latest events, send the events it missed there, oldest
    # first, this many per round (a room with more is sent in rounds), so the
    # destination need not fetch the gap (0: off, latest events only).
    missed_events_per_room: int = 50
    # Destinations woken to catch up, at most this many per second (start-up and scans).
    wakes_per_second: float = 10.0
    # How often destinations needing catch-up whose backoff has ended are looked for.
    scan_interval: timedelta = timedelta(minutes=1)


@attrs.frozen
class FederationSenderConfig:
    """``federation_sender``: outbound federation (see docs/federation-sender.md)."""

    # The spec's limits for one transaction.
    max_pdus_per_transaction: int = 50
    max_edus_per_transaction: int = 100
    transaction_timeout: timedelta = timedelta(seconds=60)
    # Outbound transactions in flight at once, across every destination.
    max_concurrent_transactions: int = 100
    # A destination with more PDUs than this waiting in memory drops them and catches up instead.
    max_pending_pdus_per_destination: int = 10_000
    # Receipts are gathered this long and sent per room in one EDU.
    receipt_delay: timedelta = timedelta(milliseconds=500)
    backoff: BackoffConfig = BackoffConfig()
    catch_up: CatchUpConfig = CatchUpConfig()
