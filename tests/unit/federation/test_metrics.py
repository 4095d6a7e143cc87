"""Federation metrics start at zero for every known label value."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from homeserver.remote.metrics import METHODS, PDU_OUTCOMES, REQUEST_OUTCOMES, TRANSACTION_OUTCOMES, FederationMetrics


def test_series_are_preinitialised() -> None:
    registry = CollectorRegistry()
    FederationMetrics.create(registry)
    for outcome in TRANSACTION_OUTCOMES:
        assert registry.get_sample_value("tributary_federation_transactions_received_total", {"outcome": outcome}) == 0
    for outcome in PDU_OUTCOMES:
        assert registry.get_sample_value("tributary_federation_pdus_received_total", {"outcome": outcome}) == 0
    for method in METHODS:
        for outcome in REQUEST_OUTCOMES:
            labels = {"method": method, "outcome": outcome}
            assert registry.get_sample_value("tributary_federation_requests_sent_total", labels) == 0
