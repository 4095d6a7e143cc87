"""The application service sender's metrics, labelled by service ID (a closed set: the
registrations in the config). Listed in docs/metrics.md."""

# tests: tests/integration/test_metrics_doc.py, tests/integration/test_appservice.py

from __future__ import annotations

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge


@attrs.frozen
class AppServiceMetrics:
    sent: Counter
    failed: Counter
    events: Counter
    pending: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> AppServiceMetrics:
        return cls(
            sent=Counter("tributary_appservice_transactions_sent_total",
                         "Transactions an application service accepted.", ["service"], registry=registry),
            failed=Counter("tributary_appservice_transactions_failed_total",
                           "Attempts to send a transaction that failed (each retry counts).", ["service"],
                           registry=registry),
            events=Counter("tributary_appservice_events_sent_total",
                           "Events in transactions an application service accepted.", ["service"],
                           registry=registry),
            pending=Gauge("tributary_appservice_events_pending",
                          "Positions of the events stream above what the service has been sent (events not yet "
                          "sent or not yet looked at).", ["service"], registry=registry),
        )
