"""Encode once, send many: a transaction body joined from pre-encoded PDUs, and a request
signature made over pre-encoded content, are byte for byte the canonical JSON that encoding
the whole value would give, so a receiver that re-encodes what it parsed verifies them."""

# tests: federation_sender/queue.py (PlannedTransaction.body), homeserver/remote/request_auth.py (request_message)

from __future__ import annotations

import json
from typing import Any

from canonicaljson import encode_canonical_json
from hypothesis import given
from hypothesis import strategies as st
from signedjson.key import generate_signing_key, get_verify_key

from federation_sender.queue import Edu, PendingPdu, PlannedTransaction, encode_pdu
from homeserver.remote.request_auth import (
    parse_x_matrix,
    request_json,
    request_message,
    sign_encoded_request,
    verify_request_signature,
)

KEY = generate_signing_key("k1")
# Text with what canonical JSON escapes or leaves alone: quotes, backslashes, controls, non-ASCII.
TEXT = st.text(alphabet=st.sampled_from(list('ab"\\\x00\x1f\u2028é😀{}:,')) | st.characters(blacklist_categories=("Cs",)), max_size=12)
JSON: Any = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53) + 1, 2**53 - 1) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
PDUS = st.lists(st.dictionaries(TEXT, JSON, max_size=5), max_size=5)
EDUS = st.lists(st.tuples(TEXT, st.dictionaries(TEXT, JSON, max_size=3)), max_size=3)


@given(PDUS, EDUS, TEXT, st.integers(0, 2**53 - 1))
def test_a_joined_body_is_the_canonical_json_of_the_whole(pdus: list[dict[str, Any]],
                                                           edus: list[tuple[str, dict[str, Any]]],
                                                           origin: str, now_ms: int) -> None:
    txn = PlannedTransaction(
        "t1", tuple(PendingPdu(f"$e{i}", "!r", i, encode_pdu(p), 0.0) for i, p in enumerate(pdus)),
        tuple(Edu(t, c) for t, c in edus),
    )
    body = txn.body(origin, now_ms)
    whole = {"origin": origin, "origin_server_ts": now_ms, "pdus": pdus,
             "edus": [{"edu_type": t, "content": c} for t, c in edus]}
    assert body == encode_canonical_json(whole)
    assert json.loads(body) == whole


@given(st.sampled_from(["GET", "put", "POST"]), TEXT, TEXT, TEXT, st.none() | JSON)
def test_a_joined_request_message_is_the_canonical_json_of_the_request(
    method: str, uri: str, origin: str, destination: str, content: Any
) -> None:
    encoded = None if content is None else encode_canonical_json(content)
    assert request_message(method, uri, origin, destination, encoded) == encode_canonical_json(
        request_json(method, uri, origin, destination, content))


@given(st.dictionaries(TEXT, JSON, max_size=5))
def test_a_signature_over_the_sent_bytes_verifies_against_the_parsed_body(content: dict[str, Any]) -> None:
    body = encode_canonical_json(content)
    header = sign_encoded_request("PUT", "/_matrix/federation/v1/send/t1", "a.example", "b.example", body, KEY)
    verify_request_signature(parse_x_matrix(header), "PUT", "/_matrix/federation/v1/send/t1", "b.example",
                             json.loads(body), get_verify_key(KEY))
