"""RemoteQueries: remote answers checked, cached with a TTL, and failures mapped to client errors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from twisted.internet.defer import Deferred

from homeserver.remote.client import FederationClientError, FederationTimeout, HttpResponseError
from homeserver.federation.queries import RemoteQueries, directory_from_answer, profile_from_answer
from storage.kernel.errors import MatrixError
from storage.stores.profiles import ProfileRow


class FakeClient:
    def __init__(self) -> None:
        self.answers: dict[str, Any] = {}
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    async def get_json(self, destination: str, path: str, query: Mapping[str, Any] | None = None) -> Any:
        self.calls.append((destination, path, dict(query or {})))
        answer = self.answers[destination]
        if isinstance(answer, Exception):
            raise answer
        return answer


def run(coro: Any) -> Any:
    result: list[Any] = []
    Deferred.fromCoroutine(coro).addBoth(result.append)
    if hasattr(result[0], "raiseException"):
        result[0].raiseException()
    return result[0]


def test_profile_answers_keep_only_valid_fields() -> None:
    assert profile_from_answer("@u:r", {"displayname": "U", "avatar_url": "mxc://r/a", "x": 1}) == \
        ProfileRow("@u:r", "U", "mxc://r/a")
    assert profile_from_answer("@u:r", {"displayname": 5, "avatar_url": "m" * 2000}) == ProfileRow("@u:r", None, None)
    with pytest.raises(MatrixError) as info:
        profile_from_answer("@u:r", ["not", "an", "object"])
    assert info.value.status == 502


def test_directory_answers_need_a_room_id_and_keep_valid_servers() -> None:
    answer = directory_from_answer("#a:r", {"room_id": "!x:r", "servers": ["r", "a" * 64 + ".org", 3, "r", "s:8448"]})
    assert answer == {"room_id": "!x:r", "servers": ["r", "s:8448"]}
    for bad in ({"servers": []}, {"room_id": "x"}, None):
        with pytest.raises(MatrixError) as info:
            directory_from_answer("#a:r", bad)
        assert info.value.status == 502


def test_answers_are_cached_until_the_ttl_and_not_found_is_404() -> None:
    now = [1000.0]
    client = FakeClient()
    queries = RemoteQueries(client, clock=lambda: now[0], cache_ttl=300, cache_size=10)
    client.answers["remote"] = {"displayname": "Bob"}
    assert run(queries.query_profile("@bob:remote")).displayname == "Bob"
    assert run(queries.query_profile("@bob:remote")).displayname == "Bob"
    assert client.calls == [("remote", "/_matrix/federation/v1/query/profile", {"user_id": "@bob:remote"})]
    now[0] += 300
    client.answers["remote"] = HttpResponseError("remote", 404, b'{"errcode":"M_NOT_FOUND"}')
    with pytest.raises(MatrixError) as info:
        run(queries.query_profile("@bob:remote"))
    assert (info.value.status, info.value.errcode) == (404, "M_NOT_FOUND")
    with pytest.raises(MatrixError):
        run(queries.query_directory("#room:remote"))
    assert len(client.calls) == 3
    with pytest.raises(MatrixError):  # the 404 is remembered
        run(queries.query_profile("@bob:remote"))
    assert len(client.calls) == 3


@pytest.mark.parametrize("failure", [
    FederationTimeout("GET timed out after 1s"),
    FederationClientError("cannot connect"),
    HttpResponseError("remote", 403, b"{}"),
    HttpResponseError("remote", 500, b"oops"),
])
def test_unreachable_or_refusing_servers_are_502_and_not_cached(failure: Exception) -> None:
    client = FakeClient()
    queries = RemoteQueries(client, clock=lambda: 0.0, cache_ttl=300, cache_size=10)
    client.answers["remote"] = failure
    for _ in range(2):
        with pytest.raises(MatrixError) as info:
            run(queries.query_directory("#room:remote"))
        assert (info.value.status, info.value.errcode) == (502, "M_UNKNOWN")
    assert len(client.calls) == 2
