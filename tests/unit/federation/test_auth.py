"""X-Matrix request signing and verification, without a network."""

from __future__ import annotations

import pytest
from signedjson.key import generate_signing_key, get_verify_key

from homeserver.remote.request_auth import (
    XMatrixError,
    authenticate_request,
    parse_x_matrix,
    sign_request,
    verify_request_signature,
)
from storage.kernel.errors import MatrixError
from tests.twisted_plugin import run_sync

KEY = generate_signing_key("k1")
URI = "/_matrix/federation/v1/send/txn1?x=1"
BODY = {"pdus": [], "edus": [{"edu_type": "m.typing", "content": {"typing": True}}]}


def _header(**overrides: str) -> str:
    return sign_request(
        overrides.get("method", "PUT"), overrides.get("uri", URI), "origin.test",
        overrides.get("destination", "dest.test"), BODY, KEY,
    )


def test_parse_round_trip() -> None:
    auth = parse_x_matrix(_header())
    assert (auth.origin, auth.destination, auth.key) == ("origin.test", "dest.test", "ed25519:k1")


def test_parse_accepts_unquoted_values_and_spaces() -> None:
    auth = parse_x_matrix('X-Matrix origin=a.test, key="ed25519:k", sig="abc"')
    assert (auth.origin, auth.destination, auth.key, auth.sig) == ("a.test", None, "ed25519:k", "abc")


@pytest.mark.parametrize("header", ["Bearer abc", "X-Matrix origin=a.test", "X-Matrix ,,,", "X-Matrix " + "a" * 5000])
def test_parse_rejects(header: str) -> None:
    with pytest.raises(XMatrixError):
        parse_x_matrix(header)


def test_signature_verifies_for_the_signed_request() -> None:
    verify_request_signature(parse_x_matrix(_header()), "PUT", URI, "dest.test", BODY, get_verify_key(KEY))


@pytest.mark.parametrize(
    "method,uri,destination,body",
    [
        ("POST", URI, "dest.test", BODY),                      # another method
        ("PUT", URI + "&y=2", "dest.test", BODY),               # another URI
        ("PUT", URI, "other.test", BODY),                       # another destination
        ("PUT", URI, "dest.test", {"pdus": []}),                # another body
        ("PUT", URI, "dest.test", None),                        # body dropped
    ],
)
def test_signature_fails_for_anything_else(method: str, uri: str, destination: str, body: object) -> None:
    with pytest.raises(XMatrixError):
        verify_request_signature(parse_x_matrix(_header()), method, uri, destination, body, get_verify_key(KEY))


def test_signature_fails_with_another_key() -> None:
    other = generate_signing_key("k1")
    with pytest.raises(XMatrixError):
        verify_request_signature(parse_x_matrix(_header()), "PUT", URI, "dest.test", BODY, get_verify_key(other))


def _authenticate(headers: list[bytes] | None, keys: dict[tuple[str, str], object]) -> str:
    async def lookup(server: str, key_id: str) -> object:
        return keys.get((server, key_id))

    return run_sync(authenticate_request(headers, "PUT", URI, "dest.test", BODY, lookup))  # type: ignore[arg-type]


def test_authenticate_returns_the_origin() -> None:
    keys = {("origin.test", "ed25519:k1"): get_verify_key(KEY)}
    assert _authenticate([_header().encode()], keys) == "origin.test"


@pytest.mark.parametrize(
    "headers,keys",
    [
        (None, {}),                                                             # no header
        ([_header().encode()], {}),                                             # unknown origin / key
        ([_header(destination="other.test").encode()], {("origin.test", "ed25519:k1"): get_verify_key(KEY)}),
        ([_header().encode()], {("origin.test", "ed25519:k1"): get_verify_key(generate_signing_key("x"))}),
        ([b"\xff\xfe"], {}),                                                    # not UTF-8
    ],
)
def test_authenticate_failures_are_401(headers: list[bytes] | None, keys: dict[tuple[str, str], object]) -> None:
    with pytest.raises(MatrixError) as info:
        _authenticate(headers, keys)
    assert (info.value.status, info.value.errcode) == (401, "M_UNAUTHORIZED")


@pytest.mark.parametrize(
    "header",
    [
        'X-Matrix origin="' + "a" * 64 + '.test",key="ed25519:k1",sig="abc"',  # a DNS label over 63
        'X-Matrix origin="a.test:0",key="ed25519:k1",sig="abc"',
        'X-Matrix origin="a\x00.test",key="ed25519:k1",sig="abc"',
        'X-Matrix origin="a.test",destination="b..test",key="ed25519:k1",sig="abc"',
        'X-Matrix origin="a.test",key="ed25519:k\x001",sig="abc"',
        'X-Matrix origin="a.test",key="nocolon",sig="abc"',
    ],
)
def test_invalid_origins_and_key_ids_fail_before_any_key_lookup(header: str) -> None:
    looked_up: list[tuple[str, str]] = []

    async def lookup(server: str, key_id: str) -> object:
        looked_up.append((server, key_id))
        return None

    with pytest.raises(MatrixError) as info:
        run_sync(authenticate_request([header.encode()], "PUT", URI, "dest.test", BODY, lookup))  # type: ignore[arg-type]
    assert (info.value.status, info.value.errcode) == (401, "M_UNAUTHORIZED")
    assert looked_up == []


def test_a_body_checked_as_it_came_or_in_its_canonical_spelling() -> None:
    """The signed message is first made with the body's bytes joined in as they came; a body in
    another spelling than the one signed is checked in the canonical one, as the spec says."""
    from homeserver.events import encode_canonical
    from homeserver.remote.request_auth import sign_encoded_request

    verify = get_verify_key(KEY)
    canonical = encode_canonical(BODY)
    spaced = b'{ "edus": [{"content": {"typing": true}, "edu_type": "m.typing"}], "pdus": [] }'
    # Signed in the canonical spelling (as senders do): verifies sent that way or spaced out.
    for raw in (canonical, spaced):
        verify_request_signature(parse_x_matrix(_header()), "PUT", URI, "dest.test", BODY, verify, raw_content=raw)
    # Signed over the very bytes sent, spaced out: the origin signed a text whose one parse is
    # this request.
    header = sign_encoded_request("PUT", URI, "origin.test", "dest.test", spaced, KEY)
    verify_request_signature(parse_x_matrix(header), "PUT", URI, "dest.test", BODY, verify, raw_content=spaced)
    # Another body fails in either spelling.
    other = {"pdus": []}
    for raw in (encode_canonical(other), b'{ "pdus": [] }'):
        with pytest.raises(XMatrixError):
            verify_request_signature(parse_x_matrix(_header()), "PUT", URI, "dest.test", other, verify,
                                     raw_content=raw)
    with pytest.raises(XMatrixError):  # the signed bytes, for another destination
        verify_request_signature(parse_x_matrix(header), "PUT", URI, "other.test", BODY, verify, raw_content=spaced)


def test_a_body_with_no_canonical_spelling_verifies_as_sent_or_is_an_xmatrix_error() -> None:
    """A transaction whose PDUs are judged one by one may hold a value canonical JSON cannot
    encode (an overflowed float, a lone surrogate, in a PDU the handler then refuses). Signed over
    its bytes as sent, it verifies; signed over anything else it is an ``XMatrixError`` (a 401),
    never the encoder's ValueError (a 500)."""
    from homeserver.remote.request_auth import sign_encoded_request

    verify = get_verify_key(KEY)
    raw = b'{"edus":[{"content":{"x":"\\ud800"},"edu_type":"m.typing"}],"pdus":[{"depth":1e400}]}'
    content = {"edus": [{"content": {"x": "\ud800"}, "edu_type": "m.typing"}], "pdus": [{"depth": float("inf")}]}
    header = sign_encoded_request("PUT", URI, "origin.test", "dest.test", raw, KEY)
    verify_request_signature(parse_x_matrix(header), "PUT", URI, "dest.test", content, verify, raw_content=raw)
    with pytest.raises(XMatrixError, match="no canonical JSON"):
        verify_request_signature(parse_x_matrix(_header()), "PUT", URI, "dest.test", content, verify,
                                 raw_content=raw)
