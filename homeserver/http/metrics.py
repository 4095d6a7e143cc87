"""Prometheus metrics of the HTTP layer, declared against a given registry."""

# tests: tests/integration/test_metrics_doc.py

from __future__ import annotations

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONNECTION_LIMIT_REASONS = ("header_timeout", "body_timeout", "idle_timeout", "per_ip_cap")
KNOWN_METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD"})


def method_label(method: str) -> str:
    """Methods outside the known set share one label value, keeping the set closed."""
    return method if method in KNOWN_METHODS else "other"


@attrs.frozen
class HttpMetrics:
    requests: Counter
    duration: Histogram
    in_flight: Gauge
    connections_closed: Counter
    connections_open: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> HttpMetrics:
        metrics = cls(
            requests=Counter(
                "tributary_http_requests_total",
                "HTTP requests answered, by servlet, method and status class (2xx, 4xx...).",
                ["servlet", "method", "status_class"],
                registry=registry,
            ),
            duration=Histogram(
                "tributary_http_request_duration_seconds",
                "Time from receiving an HTTP request to finishing its response, by servlet.",
                ["servlet"],
                buckets=DURATION_BUCKETS,
                registry=registry,
            ),
            in_flight=Gauge(
                "tributary_http_requests_in_flight",
                "HTTP requests being processed now, by servlet.",
                ["servlet"],
                registry=registry,
            ),
            connections_closed=Counter(
                "tributary_http_connections_closed_total",
                "HTTP connections closed (or refused) by a connection limit, by the limit: header_timeout, "
                "body_timeout, idle_timeout or per_ip_cap.",
                ["reason"],
                registry=registry,
            ),
            connections_open=Gauge(
                "tributary_http_connections_open",
                "HTTP connections open now, on every HTTP listener of the process.",
                registry=registry,
            ),
        )
        for reason in CONNECTION_LIMIT_REASONS:
            metrics.connections_closed.labels(reason=reason)
        return metrics
