# tests: docs/metrics.md docker/grafana/tributary.json homeserver/metrics.py homeserver/handlers/sync/metrics.py storage/metrics.py
"""docs/metrics.md and the Grafana dashboard against what a real main process serves.

One ``tributary run`` process (real PostgreSQL, a replication listener so the
replication metrics are registered) is started for the module and scraped
over HTTP. The comparison covers every family on the page, prometheus-client's
standard ``process_*`` and ``python_*`` collectors included: a metric served
but not documented fails, and so does a documented one that is not served.
The federation sender's metrics are compared the same way as soon as the main
process serves them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from tests.conftest import scratch_database
from tests.harness import REPO_ROOT, TributaryProcess, free_port
from tests.observability import (
    PREFIXES,
    MatrixUser,
    documented_metrics,
    metric_names_in_promql,
    metric_types,
    resolve,
    sample,
    samples,
    scrape,
)

DASHBOARD = REPO_ROOT / "docker" / "grafana" / "tributary.json"
SENDER_PREFIX = "tributary_federation_sender_"


@pytest.fixture(scope="module")
def main_process(postgres_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TributaryProcess]:
    tmp = tmp_path_factory.mktemp("metrics-doc")
    with scratch_database(postgres_template) as dsn:
        hs = TributaryProcess.configure(tmp, database_url=dsn)
        raw = yaml.safe_load(hs.config_path.read_text(encoding="utf-8"))
        raw["listeners"].append({"type": "replication", "port": free_port()})
        hs.config_path.write_text(yaml.safe_dump(raw), encoding="utf-8")
        hs.start()
        try:
            yield hs
        finally:
            hs.stop()


def test_docs_list_exactly_the_metrics_a_process_serves(main_process: TributaryProcess) -> None:
    served = {name: kind for name, kind in metric_types(scrape(main_process)).items() if name.startswith(PREFIXES)}
    documented = documented_metrics()
    undocumented = sorted(set(served) - set(documented))
    assert undocumented == [], f"served but missing from docs/metrics.md: {undocumented}"
    assert sorted(set(documented) - set(served)) == [], "in docs/metrics.md but not served by the main process"
    wrong_type = {name: (documented[name], kind) for name, kind in served.items() if documented[name] != kind}
    assert wrong_type == {}, "documented type differs from the served type (documented, served)"


def test_our_metrics_follow_the_naming_rules(main_process: TributaryProcess) -> None:
    """STYLE.md section 7: help text is a sentence; base units; counters end in _total."""
    for family in scrape(main_process):
        if not family.name.startswith("tributary_") or family.name.endswith("_created"):
            continue
        assert family.documentation.endswith("."), family.name
        assert not family.name.endswith(("_ms", "_milliseconds", "_mb", "_kb")), family.name
        if family.type != "counter":
            assert not family.name.endswith("_total"), f"{family.name} is a {family.type} named like a counter"


def test_metrics_move_under_load(main_process: TributaryProcess) -> None:
    """A user sends while another of their clients long-polls /sync: the HTTP,
    storage, stream, events and sync metrics all move, and the long-poll is
    counted while it waits and gone once it has answered."""
    before = samples(scrape(main_process))
    alice = MatrixUser.register(main_process.base_url, f"alice{time.monotonic_ns()}")
    room = alice.create_room()
    since = alice.sync()["next_batch"]

    answer: dict[str, Any] = {}
    poll = threading.Thread(target=lambda: answer.update(alice.sync(since, timeout_ms=20_000)))
    poll.start()
    deadline = time.monotonic() + 10
    while sample(samples(scrape(main_process)), "tributary_sync_long_polls_active") < 1:
        assert time.monotonic() < deadline, "the /sync long-poll never showed in tributary_sync_long_polls_active"
        time.sleep(0.05)
    event_id = alice.send(room, "hello metrics")
    poll.join(timeout=30)
    assert not poll.is_alive()
    timeline = answer["rooms"]["join"][room]["timeline"]["events"]
    assert event_id in [e["event_id"] for e in timeline]

    after = samples(scrape(main_process))

    def rose(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert sample(after, "tributary_sync_long_polls_active") == 0
    assert rose("tributary_sync_wake_latency_seconds_count") >= 1
    assert rose("tributary_sync_duration_seconds_count", kind="incremental") >= 1
    assert rose("tributary_sync_duration_seconds_count", kind="initial") >= 1
    # createRoom persists several events (create, member, power levels, ...) plus our message.
    assert rose("tributary_events_persisted_total", origin="local") >= 5
    assert rose("tributary_events_persist_duration_seconds_count") >= 5
    assert rose("tributary_stream_facts_written_total", stream="events") >= 5
    assert rose("tributary_stream_position", stream="events", writer="master") >= 5
    assert rose("tributary_http_requests_total", servlet="client_room_send", method="PUT", status_class="2xx") == 1
    assert rose("tributary_http_request_duration_seconds_count", servlet="client_sync") >= 2
    assert sum(v for (name, _), v in after.items() if name == "tributary_storage_txn_duration_seconds_count") > sum(
        v for (name, _), v in before.items() if name == "tributary_storage_txn_duration_seconds_count"
    )
    # The reactor monitor ticks every 0.5 s: a quick run may finish before the first tick.
    deadline = time.monotonic() + 5
    while sample(after, "tributary_reactor_tick_lag_seconds_count") < 1:
        assert time.monotonic() < deadline, "the reactor tick monitor never recorded a tick"
        time.sleep(0.1)
        after = samples(scrape(main_process))


# --- the Grafana dashboard ------------------------------------------------------------


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _sender_metrics_declared() -> dict[str, str]:
    """The federation sender's metrics as its own module declares them, for as
    long as the main process does not serve them yet (the sender is landing
    separately); None of this applies once it does."""
    from federation_sender.metrics import FederationSenderMetrics

    registry = CollectorRegistry()
    FederationSenderMetrics.create(registry)
    types: dict[str, str] = {}
    for family in registry.collect():
        types[family.name + "_total" if family.type == "counter" else family.name] = family.type
    return types


def test_every_dashboard_query_names_a_metric_that_is_served_and_documented(main_process: TributaryProcess) -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    served = metric_types(scrape(main_process))
    documented = documented_metrics()
    known = {name: kind for name, kind in served.items() if name in documented}
    sender_pending = not any(name.startswith(SENDER_PREFIX) for name in served)
    if sender_pending:
        # Until the main process serves them, sender panels are checked against
        # the sender's own declarations (still real names, never a guess).
        known.update(_sender_metrics_declared())
    groups_seen: set[str] = set()
    exprs = 0
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"]
            exprs += 1
            names = metric_names_in_promql(expr)
            assert names, f"panel {panel['title']!r}: {expr!r} names no metric"
            for name in names:
                metric = resolve(name, known)
                assert metric is not None, (
                    f"panel {panel['title']!r}: {name} is not a metric the main process serves "
                    f"and docs/metrics.md documents"
                )
                groups_seen.add(_group(metric))
    assert exprs >= 20
    # The metric groups: each has at least one panel.
    assert {"http", "storage", "stream", "replication", "events", "sync", "federation", "federation_sender",
            "process", "reactor"} <= groups_seen


def _group(metric: str) -> str:
    if metric.startswith(SENDER_PREFIX):
        return "federation_sender"
    if metric.startswith("tributary_"):
        return metric.split("_")[1]
    return "process"


def test_dashboard_is_loadable_by_grafana_provisioning() -> None:
    """What Grafana needs to load the file as provisioned: unique panel IDs and
    positions, every query on the provisioned Prometheus data source, and a
    dashboards provider pointing at the directory the file is mounted in."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    assert "id" not in dashboard or dashboard["id"] is None
    datasources = yaml.safe_load((REPO_ROOT / "docker/grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {d["uid"] for d in datasources["datasources"] if d["type"] == "prometheus"}
    assert uids
    ids = [panel["id"] for panel in _panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in _panels(dashboard):
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] in uids, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] in uids
    providers = yaml.safe_load((REPO_ROOT / "docker/grafana/provisioning/dashboards/tributary.yml").read_text())
    paths = {p["options"]["path"] for p in providers["providers"]}
    compose = yaml.safe_load((REPO_ROOT / "docker/compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(m.startswith("./grafana/tributary.json:") and Path(m.split(":")[1]).parent.as_posix() in paths
               for m in mounts), mounts
