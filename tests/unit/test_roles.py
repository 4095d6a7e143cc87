"""Process roles are plug-ins: the shipped roles are found by name through their entry points,
declare what they serve, and the background role's jobs fall back to the main process."""

from __future__ import annotations

import pytest

from homeserver.config import known_roles
from homeserver.roles import MAIN, MAIN_ONLY_SERVLETS, UnknownRole, WorkerRole, load_role
from workers import roles as shipped


def test_every_shipped_role_is_found_by_name() -> None:
    assert set(known_roles()) >= {"generic", "event_persister", "federation_sender", "background", "pusher"}
    for name, role in [("generic", shipped.GENERIC), ("event_persister", shipped.EVENT_PERSISTER),
                       ("federation_sender", shipped.FEDERATION_SENDER), ("background", shipped.BACKGROUND),
                       ("pusher", shipped.PUSHER)]:
        assert load_role(name) is role and role.name == name


def test_an_unknown_role_names_the_installed_ones() -> None:
    with pytest.raises(UnknownRole, match="no worker role 'mystery'.*generic"):
        load_role("mystery")


def test_servlets_each_role_serves() -> None:
    assert MAIN.serves_servlet("client_register") and MAIN.serves_servlet("client_sync")
    assert shipped.GENERIC.serves_servlet("client_sync")
    assert not any(shipped.GENERIC.serves_servlet(s) for s in MAIN_ONLY_SERVLETS)
    assert not shipped.EVENT_PERSISTER.serves_servlet("client_sync")
    assert WorkerRole(name="x", description="").servlets == "none"


def test_only_the_appservice_background_and_pusher_roles_run_on_main_without_a_worker() -> None:
    falling_back = [name for name in known_roles() if load_role(name).main_runs_without_worker]
    assert falling_back == ["appservice", "background", "pusher"]
    assert shipped.BACKGROUND.start is not None
    assert shipped.FEDERATION_SENDER.sends_federation and not shipped.GENERIC.sends_federation
