"""The database pool's threads (storage.database._Workers): work goes to the thread idle
last, waits its turn in order when every thread is busy, and is finished before a stop."""

from __future__ import annotations

import threading

import pytest
from twisted.internet.defer import gatherResults
from twisted.internet.threads import deferToThread

from storage.database import DatabaseError, _Workers
from tests.twisted_plugin import reactor


def _thread_name() -> str:
    return threading.current_thread().name


async def test_work_one_piece_after_another_runs_on_the_thread_idle_last() -> None:
    workers = _Workers(reactor, 4, "w")
    workers.start(3)
    try:
        names = [await workers.submit(_thread_name) for _ in range(20)]
        assert len(set(names)) == 1
        # Three at once take three threads; the one that finishes last then gets the next piece.
        release = threading.Event()
        started = threading.Barrier(4, timeout=10)

        def hold(delay: float) -> str:
            started.wait()
            release.wait(10)
            threading.Event().wait(delay)
            return _thread_name()

        held = [workers.submit(hold, d) for d in (0.0, 0.05, 0.2)]
        await reactor_thread_wait(started)
        release.set()
        together = await gatherResults(held)
        assert len(set(together)) == 3
        assert await workers.submit(_thread_name) == together[2]
    finally:
        workers.stop()


async def reactor_thread_wait(barrier: threading.Barrier) -> None:
    """Join ``barrier`` from a thread of the reactor's own pool (the reactor must keep running)."""
    await deferToThread(barrier.wait)


async def test_work_beyond_the_threads_waits_its_turn_in_order() -> None:
    workers = _Workers(reactor, 2, "w")
    order: list[int] = []
    gate = threading.Event()

    def piece(i: int) -> int:
        order.append(i)  # as it is taken
        if i < 2:
            gate.wait(10)
        return i

    try:
        pieces = [workers.submit(piece, i) for i in range(10)]
        gate.set()
        assert await gatherResults(pieces) == list(range(10))
        assert sorted(order) == list(range(10)) and [i for i in order if i >= 2] == list(range(2, 10))
        assert len(workers._threads) == 2
    finally:
        workers.stop()


async def test_a_failure_arrives_as_the_callers_error() -> None:
    workers = _Workers(reactor, 1, "w")

    def fails() -> None:
        raise KeyError("boom")

    try:
        with pytest.raises(KeyError, match="boom"):
            await workers.submit(fails)
        assert await workers.submit(lambda: 7) == 7  # the thread goes on
    finally:
        workers.stop()


async def test_stop_finishes_the_work_taken_and_waiting_then_refuses_more() -> None:
    workers = _Workers(reactor, 1, "w")
    gate = threading.Event()
    done: list[int] = []

    def piece(i: int) -> int:
        gate.wait(10)
        done.append(i)
        return i

    pieces = [workers.submit(piece, i) for i in range(3)]
    stopper = threading.Thread(target=workers.stop)
    stopper.start()
    gate.set()
    stopper.join(10)
    assert not stopper.is_alive()
    assert done == [0, 1, 2]
    assert await gatherResults(pieces) == [0, 1, 2]
    assert not any(t.is_alive() for t in workers._threads)
    with pytest.raises(DatabaseError, match="closed"):
        workers.submit(_thread_name)


async def test_idle_threads_end_at_stop() -> None:
    workers = _Workers(reactor, 3, "w")
    workers.start(2)
    assert await workers.submit(_thread_name)
    workers.stop()
    assert len(workers._threads) == 2 and not any(t.is_alive() for t in workers._threads)
