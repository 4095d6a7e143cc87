"""Stream metrics follow an ID generator: writer positions as they move, facts written on commit only."""

# tests: storage/metrics.py storage/id_generators.py

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from storage.id_generators import PositionTracker, StreamIdGenerator
from storage.metrics import Children, StreamMetrics


def make_generator(name: str, writers: list[str]) -> StreamIdGenerator:
    tracker = PositionTracker(writers=writers, local_instance=writers[0])
    return StreamIdGenerator(db=None, stream_name=name, sequence="unused", tracker=tracker, persist=False)  # type: ignore[arg-type]


def write(generator: StreamIdGenerator, ids: list[int], *, committed: bool) -> None:
    """What ``run_interaction_with_streams`` does around a transaction that reserved ``ids``."""
    reservation = generator._begin_txn_reservation()
    reservation.ids.extend(ids)
    generator._end_txn_reservation(reservation, committed=committed)


def test_positions_of_every_writer_start_at_their_value_and_follow_the_generator() -> None:
    registry = CollectorRegistry()
    metrics = StreamMetrics.create(registry)
    generator = make_generator("events", ["main", "persister1"])
    metrics.track(generator)

    def position(writer: str) -> float | None:
        return registry.get_sample_value("tributary_stream_position", {"stream": "events", "writer": writer})

    assert position("main") == 0 and position("persister1") == 0
    assert registry.get_sample_value("tributary_stream_facts_written_total", {"stream": "events"}) == 0
    write(generator, [1, 2, 3], committed=True)
    assert position("main") == 3
    generator.advance("persister1", 7)
    assert position("persister1") == 7
    # With nothing of its own in flight, the local writer is known complete up
    # to the newest ID seen: the gauge shows the generator's own answer.
    assert position("main") == generator.get_position("main")


def test_facts_written_counts_committed_writes_only() -> None:
    """A rolled-back transaction completes its IDs (the position moves past
    them) but wrote no fact."""
    registry = CollectorRegistry()
    metrics = StreamMetrics.create(registry)
    generator = make_generator("receipts", ["main"])
    metrics.track(generator)
    write(generator, [1, 2], committed=True)
    write(generator, [3], committed=False)
    write(generator, [], committed=True)
    assert registry.get_sample_value("tributary_stream_facts_written_total", {"stream": "receipts"}) == 2
    assert registry.get_sample_value("tributary_stream_position", {"stream": "receipts", "writer": "main"}) == 3
    for family in registry.collect():
        assert family.documentation.endswith(".")


def test_children_are_the_metrics_own_children_made_once_each() -> None:
    registry = CollectorRegistry()
    one = Counter("one_label_total", "", ["outcome"], registry=registry)
    two = Gauge("two_labels", "", ["stream", "writer"], registry=registry)
    ones, twos = Children(one), Children(two)
    ones["hit"].inc(2)
    ones["hit"].inc()
    twos["events", "main"].set(5)
    assert registry.get_sample_value("one_label_total", {"outcome": "hit"}) == 3
    assert registry.get_sample_value("two_labels", {"stream": "events", "writer": "main"}) == 5
    assert ones["hit"] is one.labels("hit") and twos["events", "main"] is two.labels("events", "main")
    assert ones["hit"] is ones["hit"] and len(ones) == 1 and len(twos) == 1
