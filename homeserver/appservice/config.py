"""The ``app_service_sender`` section of homeserver.yaml as typed values (parsed in homeserver/config.py).

docs/appservices.md describes every key; the defaults here are the documented ones. The
registrations themselves (``app_service_config_files``) are ``registration.AppService``.
"""

# tests: tests/unit/test_config.py

from __future__ import annotations

from datetime import timedelta

import attrs

from federation_sender.config import BackoffConfig

# A service is retried sooner than a server: it is usually on the same machine, and it has
# no other way to get what it missed.
DEFAULT_APP_SERVICE_BACKOFF = BackoffConfig(
    initial=timedelta(seconds=1), multiplier=2.0, max=timedelta(minutes=5), jitter=(0.8, 1.2)
)


@attrs.frozen
class AppServiceSenderConfig:
    backoff: BackoffConfig = DEFAULT_APP_SERVICE_BACKOFF
    # Events of the stream read per transaction (a transaction carries those of them the
    # service is interested in).
    max_events_per_transaction: int = 100
    # How long a service has to answer a transaction or a query.
    request_timeout: timedelta = timedelta(seconds=30)
