# tests: tests/unit/replication/test_transport.py
"""How long a transport waits before it tries its peer again.

One schedule for both transports: a worker's TCP client after a lost or failed
connection (``replication.transport``), and every process's Redis session
(``replication.redis_transport``). Pure: the caller counts the attempts, draws
the randomness and sets the timer.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Final

from storage.kernel.backoff import BackoffPolicy

__all__ = [
    "RECONNECT_BACKOFF",
    "RECONNECT_FACTOR",
    "RECONNECT_INITIAL_DELAY_SECONDS",
    "RECONNECT_JITTER",
    "RECONNECT_MAX_DELAY_SECONDS",
    "backoff_delay",
]

#: The first retry waits this long, each failure doubles it up to the maximum,
#: and every delay is randomised by +-20% so that workers restarted together do
#: not reconnect in lock-step.
RECONNECT_INITIAL_DELAY_SECONDS: Final = 0.5
RECONNECT_MAX_DELAY_SECONDS: Final = 30.0
RECONNECT_FACTOR: Final = 2.0
RECONNECT_JITTER: Final = 0.2
RECONNECT_BACKOFF: Final = BackoffPolicy(
    initial=RECONNECT_INITIAL_DELAY_SECONDS, multiplier=RECONNECT_FACTOR, maximum=RECONNECT_MAX_DELAY_SECONDS,
    jitter=(1 - RECONNECT_JITTER, 1 + RECONNECT_JITTER),
)


def backoff_delay(attempt: int, rand: Callable[[], float] = random.random) -> float:
    """Seconds to wait before reconnection attempt ``attempt`` (1-based); ``rand`` draws from [0, 1)."""
    return RECONNECT_BACKOFF.delay(attempt, lambda low, high: low + (high - low) * rand())
