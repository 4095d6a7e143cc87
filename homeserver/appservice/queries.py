"""What the client API asks application services: unknown users and aliases in their
namespaces, third-party protocol lookups, and pings.

- ``query_user``/``query_alias``: the spec's ``GET /_matrix/app/v1/users/{userId}`` and
  ``/rooms/{roomAlias}``, asked of each service whose namespace holds the name (exclusive or
  not) until one says it made it; the caller then reads its own tables again.
- ``thirdparty_*``: the ``/thirdparty/*`` client endpoints, answered by the services that
  registered the protocol (all services for the reverse lookups); answers that are not the
  spec's shapes are left out.
- ``ping``: ``POST /_matrix/app/v1/ping`` for ``POST /_matrix/client/v1/appservice/{id}/ping``.

A service that cannot be reached counts as "no" (logged), except for a ping, whose point is
to say so.
"""

# tests: tests/integration/test_appservice.py

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

from homeserver.appservice.client import AppServiceClient, ServiceUnreachable
from homeserver.appservice.registration import AppService, AppServiceRegistry
from storage.kernel.errors import MatrixError, not_found

logger = logging.getLogger(__name__)

# The fields each third-party lookup's entries must have (the spec's Location and User).
_REQUIRED = {"location": ("alias", "protocol", "fields"), "user": ("userid", "protocol", "fields")}


class AppServiceQueries:
    def __init__(self, registry: AppServiceRegistry, client: AppServiceClient, *,
                 clock_ms: Callable[[], int]) -> None:
        self.registry = registry
        self._client = client
        self._clock_ms = clock_ms

    async def query_user(self, user_id: str) -> bool:
        """Whether a service says it created ``user_id`` (asked of those whose namespaces hold it)."""
        for service in self.registry.user_query_targets(user_id):
            try:
                if await self._client.query_user(service, user_id):
                    return True
            except ServiceUnreachable as e:
                logger.warning("[%s] user query for %s failed: %s", service.id, user_id, e)
        return False

    async def query_alias(self, alias: str) -> bool:
        for service in self.registry.alias_query_targets(alias):
            try:
                if await self._client.query_alias(service, alias):
                    return True
            except ServiceUnreachable as e:
                logger.warning("[%s] alias query for %s failed: %s", service.id, alias, e)
        return False

    # --- third-party lookups -----------------------------------------------------------------

    async def _get(self, service: AppService, path: str, query: Mapping[str, str]) -> Any:
        try:
            status, body = await self._client.request(service, "GET", path, query=query)
        except ServiceUnreachable as e:
            logger.warning("[%s] GET %s failed: %s", service.id, path.split("?")[0], e)
            return None
        return body if status == 200 else None

    async def protocols(self) -> dict[str, Any]:
        """Every registered protocol's metadata; the instances of services sharing one are merged."""
        found: dict[str, dict[str, Any]] = {}
        for service in self.registry.services:
            for protocol in service.protocols if service.url is not None else ():
                metadata = await self._get(service, "/_matrix/app/v1/thirdparty/protocol/" + quote(protocol, safe=""),
                                           {})
                if not isinstance(metadata, dict):
                    continue
                instances = [i for i in metadata.get("instances") or [] if isinstance(i, dict)]
                if protocol in found:
                    found[protocol]["instances"].extend(instances)
                else:
                    found[protocol] = {**metadata, "instances": instances}
        return found

    async def protocol(self, protocol: str) -> dict[str, Any]:
        if not self.registry.with_protocol(protocol):
            raise not_found(f"No application service provides the protocol {protocol}")
        metadata: dict[str, Any] | None = (await self.protocols()).get(protocol)
        if metadata is None:
            raise not_found(f"The application service for {protocol} did not answer")
        return metadata

    async def lookup(self, kind: str, protocol: str | None, query: Mapping[str, str]) -> list[Any]:
        """``kind`` "location" or "user": by protocol (its services) or, with None, in reverse
        (every service) — the concatenated answers that have the spec's fields."""
        if protocol is None:
            services = self.registry.pushed_to()
            path = f"/_matrix/app/v1/thirdparty/{kind}"
        else:
            services = self.registry.with_protocol(protocol)
            if not services:
                raise not_found(f"No application service provides the protocol {protocol}")
            path = f"/_matrix/app/v1/thirdparty/{kind}/" + quote(protocol, safe="")
        results: list[Any] = []
        for service in services:
            answer = await self._get(service, path, query)
            if isinstance(answer, list):
                results.extend(item for item in answer
                               if isinstance(item, dict) and all(key in item for key in _REQUIRED[kind]))
        return results

    # --- ping -----------------------------------------------------------------------------------

    async def ping(self, service: AppService, transaction_id: str | None) -> int:
        """``duration_ms`` of a successful ping; else the spec's errors."""
        if service.url is None:
            raise MatrixError(400, "M_URL_NOT_SET", "The application service has no url")
        body = {} if transaction_id is None else {"transaction_id": transaction_id}
        start = self._clock_ms()
        try:
            status, answer = await self._client.request(service, "POST", "/_matrix/app/v1/ping", body=body)
        except ServiceUnreachable as e:
            if e.timed_out:
                raise MatrixError(504, "M_CONNECTION_TIMEOUT", "The application service did not answer in time") \
                    from None
            raise MatrixError(502, "M_CONNECTION_FAILED", "Could not connect to the application service") from None
        if status != 200:
            text = "" if answer is None else str(answer)[:1000]
            error = MatrixError(502, "M_BAD_STATUS", f"The application service answered {status}", body=text)
            error.extra["status"] = status  # the spec's field; ``status`` is the constructor's own argument
            raise error
        return max(0, self._clock_ms() - start)
