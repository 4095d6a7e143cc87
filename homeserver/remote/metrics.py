"""Federation metrics: inbound transactions and PDUs by outcome, outbound requests by outcome, gaps filled,
partial-state resyncs."""

# tests: tests/unit/federation/test_metrics.py

from __future__ import annotations

from typing import Final

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TRANSACTION_OUTCOMES: Final = ("processed", "repeat", "refused")
PDU_OUTCOMES: Final = ("accepted", "rejected", "soft_failed", "invalid", "missing_events")
REQUEST_OUTCOMES: Final = ("ok", "http_error", "network_error", "timeout")
METHODS: Final = ("GET", "PUT", "POST")
GAP_METHODS: Final = ("get_missing_events", "state_ids")
# A room's state resync after a partial-state join, per server asked: stored, or that server failed.
RESYNC_OUTCOMES: Final = ("completed", "failed")
ROUND_SIZES: Final = ("one", "several")


@attrs.frozen
class FederationMetrics:
    transactions: Counter
    pdus: Counter
    requests: Counter
    gaps_filled: Counter
    partial_state_resyncs: Counter
    partial_state_resync_duration: Histogram
    room_rounds: Counter
    room_round_waiting: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> FederationMetrics:
        metrics = cls(
            transactions=Counter(
                "tributary_federation_transactions_received_total",
                "Inbound PUT /send transactions, by outcome (processed, a repeat answered from storage, refused).",
                ["outcome"], registry=registry,
            ),
            pdus=Counter(
                "tributary_federation_pdus_received_total",
                "PDUs received in inbound transactions, by the outcome of their checks.",
                ["outcome"], registry=registry,
            ),
            requests=Counter(
                "tributary_federation_requests_sent_total",
                "Outbound federation requests, by HTTP method and outcome.",
                ["method", "outcome"], registry=registry,
            ),
            gaps_filled=Counter(
                "tributary_federation_gaps_filled_total",
                "Gaps in front of received PDUs that were filled, by method: a get_missing_events walk that "
                "reached our timeline, or the state before an event taken from /state_ids.",
                ["method"], registry=registry,
            ),
            partial_state_resyncs=Counter(
                "tributary_federation_partial_state_resyncs_total",
                "Attempts to fetch and store the full state of a room joined with partial state, one per "
                "server asked, by outcome (completed, or that server failed and the next is asked).",
                ["outcome"], registry=registry,
            ),
            partial_state_resync_duration=Histogram(
                "tributary_federation_partial_state_resync_duration_seconds",
                "Time from a partial-state join (or the process's start, for a resumed room) to the room's "
                "full state stored.",
                buckets=(0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0),
                registry=registry,
            ),
            room_rounds=Counter(
                "tributary_federation_room_rounds_total",
                "Rounds in which received PDUs of one room were checked and persisted, by how many inbound "
                "transactions they took together (one, or several that reached the room while a round ran).",
                ["transactions"], registry=registry,
            ),
            room_round_waiting=Gauge(
                "tributary_federation_room_round_waiting",
                "Inbound transactions waiting for a room's next round (another round of the room is running).",
                registry=registry,
            ),
        )
        for outcome in TRANSACTION_OUTCOMES:
            metrics.transactions.labels(outcome=outcome)
        for outcome in PDU_OUTCOMES:
            metrics.pdus.labels(outcome=outcome)
        for method in METHODS:
            for outcome in REQUEST_OUTCOMES:
                metrics.requests.labels(method=method, outcome=outcome)
        for method in GAP_METHODS:
            metrics.gaps_filled.labels(method=method)
        for outcome in RESYNC_OUTCOMES:
            metrics.partial_state_resyncs.labels(outcome=outcome)
        for transactions in ROUND_SIZES:
            metrics.room_rounds.labels(transactions=transactions)
        return metrics
