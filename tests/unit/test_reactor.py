import pytest

from twisted.internet import threads
from twisted.internet.asyncioreactor import AsyncioSelectorReactor

from homeserver.reactor import install_reactor


def test_installed_reactor_is_asyncio_on_uvloop() -> None:
    reactor = install_reactor()
    assert isinstance(reactor, AsyncioSelectorReactor)
    assert type(reactor._asyncioEventloop).__module__.startswith("uvloop")
    assert install_reactor() is reactor


async def test_async_tests_can_await_deferreds_and_threads() -> None:
    result = await threads.deferToThread(lambda: 6 * 7)
    assert result == 42


def test_a_test_that_ignores_its_cancellation_fails_with_a_report_rather_than_hang(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's own plugin: a test still waiting past its timeout and the grace after it
    (what it awaits ignored the cancellation, as a begun transaction does) fails, saying what
    it waits for, and the loop is free for the next test."""
    from twisted.internet.defer import Deferred

    from storage.database import delay_cancellation
    from tests import twisted_plugin

    monkeypatch.setattr(twisted_plugin, "HANG_GRACE_SECONDS", 0.2)

    async def stuck() -> None:
        await delay_cancellation(Deferred())  # cancelling it waits for what never ends

    with pytest.raises(twisted_plugin.TestDidNotEnd) as failed:
        twisted_plugin.run_sync(stuck(), timeout=0.1)
    report = str(failed.value)
    assert "did not end within 0 s, nor 0 s after its cancellation" in report
    assert "in stuck" in report and "await delay_cancellation(Deferred())" in report
    assert "the reactor thread's database connections:" in report
    assert twisted_plugin.run_sync(threads.deferToThread(lambda: 42)) == 42
