"""Outbound lookups against a real ``tributary`` process and the signing test peer.

The process runs with short ``federation_limits`` (1 s per request and per key query), so a
peer that never answers proves each bound in about a second, without sleeps: key queries
naming invalid or silent servers are answered at once or within the key query's limit,
notary GETs work, the caps and the rate limit answer 400 and 429; a client's remote profile
and alias lookups go over federation, are cached, and fail as 404 or 502, never hang.
"""

# tests: homeserver/federation/keys.py, homeserver/federation/queries.py, homeserver/remote/client.py

from __future__ import annotations

import time
from collections.abc import Iterator
from urllib.parse import quote

import pytest
from signedjson.key import generate_signing_key

from homeserver.remote.client import FederationClient, HttpResponseError
from homeserver.federation.keys import parse_key_response
from tests.federation_peer import Behaviour, FederationPeer
from tests.integration.test_federation_peer import Tributary, running_tributary
from tests.twisted_plugin import reactor, run_sync

LIMITS = {"request_timeout": "1s", "tls_timeout": "1s", "key_fetch_timeout": "20s", "key_query_timeout": "1s",
          "key_query_max_servers": 4, "rc_key_query": {"per_second": 0.001, "burst_count": 6}}


@pytest.fixture(scope="module")
def tributary(postgres_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tributary]:
    with running_tributary(postgres_template, tmp_path_factory.mktemp("tributary"), federation_limits=LIMITS) as running:
        yield running


@pytest.fixture
def peer() -> Iterator[FederationPeer]:
    p = FederationPeer(reactor, request_timeout_seconds=10)
    yield p
    run_sync(p.stop())


@pytest.fixture
def stranger() -> Iterator[FederationClient]:
    """Asks the process for keys; its 15 s limit is far above what any answer may take."""
    client = FederationClient(reactor, server_name="stranger.invalid", signing_key=generate_signing_key("s"),
                              verify_certificates=False, ip_range_whitelist=["127.0.0.0/8"], timeout_seconds=15)
    yield client
    run_sync(client.close())


def signers(response: dict[str, object]) -> set[str]:
    signatures = response.get("signatures")
    return set(signatures) if isinstance(signatures, dict) else set()


@pytest.mark.timeout(60)
async def test_key_queries_are_bounded_capped_and_rate_limited(tributary: Tributary, peer: FederationPeer,
                                                               stranger: FederationClient) -> None:
    """A query naming a server with a 64-character DNS label used to get no answer at all; one
    naming a silent server used to wait for it (and walk the servers one by one). Now the first
    is answered at once with no keys, the second within the 1 s key query limit with the keys of
    the server that answers. The notary GETs serve one server's keys; more than four names is 400
    M_TOO_LARGE; the seventh query from one address is 429."""
    ok, silent = await peer.start(2)
    await peer.set_behaviour(silent, Behaviour.SILENT)
    server = tributary.server_name
    key_path = "/_matrix/key/v2/query"

    started = time.monotonic()
    answer = await stranger.post_json(server, key_path, {"server_keys": {"a" * 64 + ".example.org": {}}}, signed=False)
    assert answer == {"server_keys": []}
    assert time.monotonic() - started < 5

    started = time.monotonic()
    answer = await stranger.post_json(server, key_path, {"server_keys": {silent: {}, ok: {}}}, signed=False)
    assert time.monotonic() - started < 5
    [keys] = answer["server_keys"]
    assert keys["server_name"] == ok and signers(keys) == {ok, server}
    assert parse_key_response(ok, keys, int(reactor.seconds() * 1000))
    assert peer.request_counts(silent)["key/server"] == 1

    key_id = next(iter(keys["verify_keys"]))
    whole = await stranger.get_json(server, f"{key_path}/{quote(ok)}", signed=False)
    one = await stranger.get_json(server, f"{key_path}/{quote(ok)}/{quote(key_id)}",
                                  query={"minimum_valid_until_ts": "1"}, signed=False)
    for reply in (whole, one):
        [keys] = reply["server_keys"]
        assert keys["server_name"] == ok and key_id in keys["verify_keys"] and signers(keys) == {ok, server}
    with pytest.raises(HttpResponseError) as info:
        await stranger.get_json(server, f"{key_path}/{quote(ok)}", query={"minimum_valid_until_ts": "soon"},
                                signed=False)
    assert (info.value.code, info.value.json["errcode"]) == (400, "M_INVALID_PARAM")

    with pytest.raises(HttpResponseError) as info:
        await stranger.post_json(server, key_path, {"server_keys": {f"s{i}.example": {} for i in range(5)}},
                                 signed=False)
    assert (info.value.code, info.value.json["errcode"]) == (400, "M_TOO_LARGE")

    with pytest.raises(HttpResponseError) as info:
        await stranger.post_json(server, key_path, {"server_keys": {}}, signed=False)
    assert (info.value.code, info.value.json["errcode"]) == (429, "M_LIMIT_EXCEEDED")
    await peer.set_behaviour(silent, Behaviour.OK)


@pytest.mark.timeout(60)
async def test_an_invalid_origin_is_refused_without_a_lookup(tributary: Tributary) -> None:
    """The same 64-character label as an X-Matrix origin used to stall the request 15 s before
    the 401: its key fetch now fails at once, so the 401 comes at once."""
    impostor = FederationClient(reactor, server_name="a" * 64 + ".example.org", signing_key=generate_signing_key("i"),
                                verify_certificates=False, ip_range_whitelist=["127.0.0.0/8"], timeout_seconds=15)
    try:
        started = time.monotonic()
        with pytest.raises(HttpResponseError) as info:
            await impostor.put_json(tributary.server_name, "/_matrix/federation/v1/send/t1", {"pdus": [], "edus": []})
        assert (info.value.code, info.value.json["errcode"]) == (401, "M_UNAUTHORIZED")
        assert time.monotonic() - started < 5
    finally:
        await impostor.close()


@pytest.mark.timeout(60)
async def test_remote_profiles_and_aliases_go_over_federation(tributary: Tributary, peer: FederationPeer) -> None:
    """Clients used to get 404 for every remote profile and alias. Now the user's or alias's
    server is asked (its answer cached: a change on the remote is not seen within the TTL), its
    404 is 404 M_NOT_FOUND, and a server that never answers or refuses connections is 502
    within the 1 s request limit."""
    remote, silent, down = await peer.start(3)
    await peer.set_behaviour(silent, Behaviour.SILENT)
    await peer.set_behaviour(down, Behaviour.DOWN)
    client = tributary.client
    peer.set_profile(remote, f"@bob:{remote}", {"displayname": "Bob", "avatar_url": f"mxc://{remote}/bob"})
    peer.set_alias(remote, f"#lobby:{remote}", {"room_id": f"!lobby:{remote}", "servers": [remote, "x" * 64]})

    bob = quote(f"@bob:{remote}")
    reply = await client.request("GET", f"profile/{bob}")
    assert (reply.status, reply.body) == (200, {"displayname": "Bob", "avatar_url": f"mxc://{remote}/bob"})
    peer.set_profile(remote, f"@bob:{remote}", {"displayname": "Robert"})
    reply = await client.request("GET", f"profile/{bob}/displayname")
    assert (reply.status, reply.body) == (200, {"displayname": "Bob"})  # from the cache
    assert peer.request_counts(remote)["query"] == 1

    reply = await client.request("GET", f"directory/room/{quote(f'#lobby:{remote}')}")
    assert (reply.status, reply.body) == (200, {"room_id": f"!lobby:{remote}", "servers": [remote]})
    for path in (f"profile/{quote(f'@nobody:{remote}')}", f"directory/room/{quote(f'#nowhere:{remote}')}"):
        reply = await client.request("GET", path)
        assert (reply.status, reply.errcode) == (404, "M_NOT_FOUND"), reply

    for server in (silent, down):
        for path in (f"profile/{quote(f'@x:{server}')}", f"directory/room/{quote(f'#x:{server}')}"):
            started = time.monotonic()
            reply = await client.request("GET", path)
            assert (reply.status, reply.errcode) == (502, "M_UNKNOWN"), reply
            assert time.monotonic() - started < 5
    await peer.set_behaviour(silent, Behaviour.OK)


@pytest.mark.timeout(60)
async def test_a_remote_canonical_alias_is_checked_with_its_server(tributary: Tributary, peer: FederationPeer) -> None:
    """m.room.canonical_alias naming another server's alias: that server is asked (as Synapse), and
    the alias is accepted only when it answers with this room; an alias it does not know, or one
    of another room, is 400 M_BAD_ALIAS and nothing is sent."""
    (remote,) = await peer.start(1)
    client = tributary.client
    token = (await client.register_ok("canon_alice"))["access_token"]
    room_id = (await client.request("POST", "createRoom", {}, token=token)).body["room_id"]
    peer.set_alias(remote, f"#here:{remote}", {"room_id": room_id, "servers": [remote]})
    peer.set_alias(remote, f"#elsewhere:{remote}", {"room_id": f"!other:{remote}", "servers": [remote]})
    path = f"rooms/{quote(room_id)}/state/m.room.canonical_alias"
    for content in ({"alias": f"#elsewhere:{remote}"}, {"alt_aliases": [f"#nowhere:{remote}"]}):
        reply = await client.request("PUT", path, content, token=token)
        assert (reply.status, reply.errcode) == (400, "M_BAD_ALIAS"), (content, reply)
    assert (await client.request("GET", path, token=token)).status == 404
    reply = await client.request("PUT", path, {"alias": f"#here:{remote}", "alt_aliases": [f"#here:{remote}"]},
                                 token=token)
    assert reply.status == 200, reply
    reply = await client.request("GET", path, token=token)
    assert reply.body == {"alias": f"#here:{remote}", "alt_aliases": [f"#here:{remote}"]}
