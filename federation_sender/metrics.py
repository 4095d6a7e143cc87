"""Federation sender metrics: what waits, what is failing, what was sent.

No per-destination labels: which destinations are down is in the logs
(``TX [destination]`` lines) and in the ``destinations`` table.
"""

# tests: tests/unit/federation_sender/test_sender.py, tests/integration/test_metrics_doc.py

from __future__ import annotations

from typing import Final

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from federation_sender.core import REFUSAL_REASONS

TRANSACTION_OUTCOMES: Final = ("ok", "failed", "rejected")
CATCH_UP_REASONS: Final = ("startup", "backoff", "overflow", "missed")
# EDU types we send; anything else is counted as "other".
EDU_TYPES: Final = (
    "m.typing", "m.receipt", "m.presence", "m.direct_to_device", "m.device_list_update", "other",
)


@attrs.frozen
class FederationSenderMetrics:
    pending_pdus: Gauge
    pending_edus: Gauge
    catching_up: Gauge
    backing_off: Gauge
    in_flight: Gauge
    oldest_pending_age: Gauge
    position: Gauge
    transactions: Counter
    transaction_duration: Histogram
    pdus_sent: Counter
    catch_up_pdus_sent: Counter
    edus_sent: Counter
    pdus_refused: Counter
    catch_up_entered: Counter
    loop_restarts: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> FederationSenderMetrics:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tributary_federation_sender_{name}", doc, registry=registry)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"tributary_federation_sender_{name}", doc, list(labels), registry=registry)

        metrics = cls(
            pending_pdus=gauge("pending_pdus", "PDUs waiting in memory for a transaction, across destinations."),
            pending_edus=gauge("pending_edus", "EDUs waiting in memory for a transaction, across destinations."),
            catching_up=gauge("destinations_catching_up", "Destinations in catch-up mode."),
            backing_off=gauge("destinations_backing_off", "Destinations with a retry interval set after failures."),
            in_flight=gauge("transactions_in_flight", "Outbound transactions waiting for an answer."),
            oldest_pending_age=gauge(
                "oldest_pending_pdu_age_seconds", "Age of the oldest PDU waiting in memory for any destination."
            ),
            position=gauge(
                "fanout_position", "The events stream position up to which new local events were fanned out."
            ),
            transactions=counter(
                "transactions_total",
                "PUT /send transactions by outcome: ok, failed (the destination backs off), "
                "rejected (a 4xx about the request: dropped without backoff).",
                ("outcome",),
            ),
            transaction_duration=Histogram(
                "tributary_federation_sender_transaction_duration_seconds",
                "Time from sending a transaction to its answer (or failure).",
                registry=registry,
                buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            ),
            pdus_sent=counter("pdus_sent_total", "PDUs in transactions the destination accepted."),
            catch_up_pdus_sent=counter(
                "catch_up_pdus_sent_total", "PDUs sent by catch-up (part of pdus_sent_total)."
            ),
            edus_sent=counter("edus_sent_total", "EDUs in accepted transactions, by EDU type.", ("edu_type",)),
            pdus_refused=counter(
                "pdus_refused_total",
                "PDUs a destination answered about but did not take, by reason: its /send answer gave the PDU "
                "an error (forbidden, signature, format, other), or it refused the whole transaction "
                "(transaction_rejected). Logged and stored in destination_pdu_errors; never resent.",
                ("reason",),
            ),
            catch_up_entered=counter(
                "catch_up_entered_total",
                "Times a destination entered catch-up: at start-up, after backing off past the threshold, "
                "after too many PDUs waited, or after PDUs were not queued while it was backing off.",
                ("reason",),
            ),
            loop_restarts=counter(
                "loop_restarts_total", "Destination loops that raised unexpectedly and were restarted."
            ),
        )
        for outcome in TRANSACTION_OUTCOMES:
            metrics.transactions.labels(outcome=outcome)
        for edu_type in EDU_TYPES:
            metrics.edus_sent.labels(edu_type=edu_type)
        for reason in CATCH_UP_REASONS:
            metrics.catch_up_entered.labels(reason=reason)
        for reason in REFUSAL_REASONS:
            metrics.pdus_refused.labels(reason=reason)
        return metrics

    def count_edu(self, edu_type: str) -> None:
        self.edus_sent.labels(edu_type=edu_type if edu_type in EDU_TYPES else "other").inc()
