"""Registration files and namespaces: parsing (errors name the file and key), who may act as
whom, what is exclusive, and which events a service is interested in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from homeserver.appservice.registration import AppServiceRegistry, EventFacts, is_interested
from homeserver.config import ConfigError, parse_app_service, parse_config

HS = "example.org"


def registration(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "id": "irc", "url": "http://127.0.0.1:9000/", "as_token": "as-secret", "hs_token": "hs-secret",
        "sender_localpart": "ircbot",
        "namespaces": {"users": [{"exclusive": True, "regex": "@irc_.*"}],
                       "aliases": [{"exclusive": True, "regex": "#irc_.*"}],
                       "rooms": [{"exclusive": False, "regex": "!bridged:.*"}]},
        "rate_limited": False, "protocols": ["irc"],
    }
    raw.update(overrides)
    return raw


def test_a_registration_parses_into_typed_values() -> None:
    service = parse_app_service(registration(**{"de.sorunome.msc2409.push_ephemeral": True,
                                                "org.matrix.msc2409.receive_to_device": True}), server_name=HS)
    assert service.id == "irc" and service.url == "http://127.0.0.1:9000"  # no trailing slash
    assert service.sender == "@ircbot:example.org"
    assert not service.rate_limited and service.protocols == ("irc",)
    assert service.receive_ephemeral  # the MSC2409 name is accepted too
    assert service.receive_to_device
    assert parse_app_service(registration(url=None), server_name=HS).url is None
    # A bridge's own section is its business.
    assert parse_app_service(registration(heisenbridge={"displayname": "H"}), server_name=HS).id == "irc"


@pytest.mark.parametrize(("change", "key"), [
    ({"id": None}, "id"),
    ({"as_token": 5}, "as_token"),
    ({"url": "ftp://x"}, "url"),
    ({"sender_localpart": "Bad Name"}, "sender_localpart"),
    ({"namespaces": {"users": [{"exclusive": True, "regex": "@irc_("}]}}, "namespaces.users[0].regex"),
    ({"namespaces": {"users": [{"regex": "@a"}]}}, "namespaces.users[0].exclusive"),
    ({"namespaces": {"people": []}}, "namespaces.people"),
    ({"rate_limited": "no"}, "rate_limited"),
    ({"namespaces": {"users": [{"exclusive": True, "regex": "@a", "colour": "blue"}]}}, "namespaces.users[0].colour"),
])
def test_errors_name_the_key(change: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_app_service(registration(**change), server_name=HS)
    assert caught.value.path == key


def test_the_url_key_is_required_even_if_null() -> None:
    raw = registration()
    del raw["url"]
    with pytest.raises(ConfigError, match="url"):
        parse_app_service(raw, server_name=HS)


def test_config_errors_name_the_file_and_key_and_tokens_are_unique(tmp_path: Path) -> None:
    good, bad, twin = tmp_path / "good.yaml", tmp_path / "bad.yaml", tmp_path / "twin.yaml"
    good.write_text(yaml.safe_dump(registration()))
    bad.write_text(yaml.safe_dump(registration(id="other", as_token="a2", hs_token="h2", rate_limited=3)))
    twin.write_text(yaml.safe_dump(registration(id="other", hs_token="h2")))
    config = parse_config({"server_name": HS, "app_service_config_files": [str(good)]})
    assert [s.id for s in config.app_services] == ["irc"]
    with pytest.raises(ConfigError) as caught:
        parse_config({"server_name": HS, "app_service_config_files": [str(good), str(bad)]})
    assert str(bad) in caught.value.path and caught.value.path.endswith("rate_limited")
    with pytest.raises(ConfigError, match="as_token"):
        parse_config({"server_name": HS, "app_service_config_files": [str(good), str(twin)]})
    with pytest.raises(ConfigError, match="cannot read"):
        parse_config({"server_name": HS, "app_service_config_files": [str(tmp_path / "missing.yaml")]})
    (tmp_path / "broken.yaml").write_text("id: [")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_config({"server_name": HS, "app_service_config_files": [str(tmp_path / "broken.yaml")]})


def test_masquerading_exclusivity_and_interest() -> None:
    irc = parse_app_service(registration(), server_name=HS)
    shared = parse_app_service(registration(
        id="shared", as_token="a2", hs_token="h2", sender_localpart="sharedbot", protocols=[],
        namespaces={"users": [{"exclusive": False, "regex": "@shared_.*"}]}), server_name=HS)
    registry = AppServiceRegistry([irc, shared])
    assert registry.by_token("as-secret") is irc and registry.by_token("hs-secret") is None
    assert irc.may_act_as("@irc_bob:example.org") and irc.may_act_as("@ircbot:example.org")
    assert not irc.may_act_as("@bob:example.org")
    # Anchored at the start only, as Synapse: a prefix elsewhere does not match.
    assert not irc.may_act_as("@bob_irc_x:example.org")
    assert registry.exclusive_user_owner("@irc_bob:example.org") is irc
    assert registry.exclusive_user_owner("@sharedbot:example.org") is shared  # a sender is its service's
    assert registry.exclusive_user_owner("@shared_x:example.org") is None  # not exclusive
    assert registry.exclusive_alias_owner("#irc_chan:example.org") is irc
    assert registry.user_query_targets("@shared_x:example.org") == (shared,)
    assert registry.with_protocol("irc") == (irc,)

    def facts(**kw: Any) -> EventFacts:
        return EventFacts(**{"sender": "@bob:example.org", "room_id": "!r:example.org", "member": None, **kw})

    assert not is_interested(irc, facts())
    assert is_interested(irc, facts(sender="@irc_x:example.org"))
    assert is_interested(irc, facts(member="@irc_x:example.org"))
    assert is_interested(irc, facts(room_id="!bridged:example.org"))
    assert is_interested(irc, facts(room_aliases=("#irc_chan:example.org",)))
    assert is_interested(irc, facts(room_members=("@bob:example.org", "@irc_y:example.org")))
    assert not is_interested(shared, facts(room_members=("@irc_y:example.org",)))
