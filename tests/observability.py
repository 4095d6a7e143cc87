"""Support for the observability tests (no tests here): scrape and name metrics, read docs/metrics.md,
drive a real process through the client API with plain HTTP.

Metric names here are the names an operator writes in PromQL: a counter is
``x_total``, a histogram ``x`` (its series are ``x_bucket``, ``x_sum`` and
``x_count``), and the ``_created`` series prometheus-client adds to counters
and histograms are not metrics of their own.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import REPO_ROOT, TributaryProcess

METRICS_DOC = REPO_ROOT / "docs" / "metrics.md"
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
#: Prefixes of the metrics a Tributary process serves: its own and prometheus-client's standard collectors.
PREFIXES = ("tributary_", "process_", "python_")


def scrape(hs: TributaryProcess) -> list[Metric]:
    status, body = hs.get("/metrics", port=hs.metrics_port)
    assert status == 200, body[:500]
    return list(text_string_to_metric_families(body.decode("utf-8")))


def metric_types(families: Iterable[Metric]) -> dict[str, str]:
    """PromQL name -> type (counter, gauge, histogram, ...) of every metric in a scrape."""
    families = list(families)
    names = {f.name for f in families}
    types: dict[str, str] = {}
    for family in families:
        base = family.name.removesuffix("_created")
        if family.name.endswith("_created") and base in names:
            continue  # the creation time of a counter or histogram
        name = family.name + "_total" if family.type == "counter" else family.name
        types[name] = family.type
    return types


def samples(families: Iterable[Metric]) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(series name, labels) -> value for every sample of a scrape."""
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


def sample(values: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return values.get((name, frozenset(labels.items())), 0.0)


_DOC_ROW = re.compile(r"^\|\s*`([a-z_:][a-z0-9_:]*)`\s*\|\s*(\w+)\s*\|")


def documented_metrics(path: Path = METRICS_DOC) -> dict[str, str]:
    """Metric name -> documented type, from every table row of docs/metrics.md."""
    documented: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        match = _DOC_ROW.match(line)
        if match:
            name, kind = match.groups()
            assert name not in documented, f"{name} is documented twice in {path.name}"
            documented[name] = kind
    return documented


_IDENTIFIER = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names_in_promql(expr: str) -> set[str]:
    """Every identifier in ``expr`` that looks like one of our metrics (label names and
    functions do not start with the prefixes; label values are quoted and dropped first)."""
    unquoted = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    return {word for word in _IDENTIFIER.findall(unquoted) if word.startswith(PREFIXES)}


def resolve(name: str, known: Mapping[str, str]) -> str | None:
    """The metric a PromQL series name belongs to (``x_bucket`` -> histogram ``x``), or None."""
    if name in known:
        return name
    for suffix in HISTOGRAM_SERIES:
        base = name.removesuffix(suffix)
        if base != name and known.get(base) in ("histogram", "summary"):
            return base
    return None


@attrs.define
class MatrixUser:
    """A user on a real process, driven with blocking HTTP (the process runs in its own OS process)."""

    base_url: str
    user_id: str = ""
    token: str = ""

    def request(self, method: str, path: str, body: Any = None, *, timeout: float = 30.0) -> Any:
        url = self.base_url + "/_matrix/client/v3/" + path
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{method} {path}: {e.code} {e.read()[:300]!r}") from None

    @classmethod
    def register(cls, base_url: str, name: str) -> MatrixUser:
        user = cls(base_url)
        result = user.request(
            "POST", "register", {"username": name, "password": "password", "auth": {"type": "m.login.dummy"}}
        )
        user.user_id, user.token = result["user_id"], result["access_token"]
        return user

    def create_room(self) -> str:
        return str(self.request("POST", "createRoom", {"preset": "private_chat"})["room_id"])

    def send(self, room_id: str, text: str) -> str:
        txn = uuid.uuid4().hex
        path = f"rooms/{urllib.parse.quote(room_id)}/send/m.room.message/{txn}"
        return str(self.request("PUT", path, {"msgtype": "m.text", "body": text})["event_id"])

    def sync(self, since: str | None = None, timeout_ms: int = 0) -> dict[str, Any]:
        query = f"sync?timeout={timeout_ms}" + (f"&since={urllib.parse.quote(since)}" if since else "")
        result: dict[str, Any] = self.request("GET", query, timeout=timeout_ms / 1000 + 30)
        return result
