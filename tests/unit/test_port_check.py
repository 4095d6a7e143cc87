"""``first_taken``: the listener check that runs before anything else at start-up."""

# tests: homeserver/port_check.py

from __future__ import annotations

import socket

from homeserver.config import ListenerConfig
from homeserver.port_check import first_taken, probe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_free_ports_pass_and_a_taken_one_is_named_with_its_listener() -> None:
    free, taken = _free_port(), _free_port()
    listeners = [ListenerConfig(type="http", port=free, resources=("client",)),
                 ListenerConfig(type="metrics", port=taken)]
    assert first_taken(listeners) is None
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen(1)
        found = first_taken(listeners)
        assert found is not None
        assert found.describe() == f"127.0.0.1:{taken} (listeners[1], metrics) is already in use"
        worker = first_taken(listeners, prefix="workers.w1.listeners")
        assert worker is not None and worker.where == "workers.w1.listeners[1], metrics"
    assert first_taken(listeners) is None  # the probe itself holds nothing afterwards


def test_an_address_of_another_machine_is_named_as_such() -> None:
    assert probe("192.0.2.1", _free_port()) == "is not an address of this machine"


def test_ipv6_addresses_are_shown_in_brackets() -> None:
    from homeserver.port_check import TakenAddress

    assert TakenAddress("::1", 8008, "listeners[0], http", "is already in use").describe() == (
        "[::1]:8008 (listeners[0], http) is already in use")
