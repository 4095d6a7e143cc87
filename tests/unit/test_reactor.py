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
