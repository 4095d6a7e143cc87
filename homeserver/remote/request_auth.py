"""``X-Matrix`` request authentication: signing outbound requests, verifying inbound ones.

The signed object is ``{method, uri, origin, destination[, content]}`` in canonical
JSON ("Request Authentication" in the server-server API). This module is pure apart
from ``authenticate_request``, which asks a key source for the origin's key; every
failure there becomes ``401 M_UNAUTHORIZED``.
"""

# tests: tests/unit/federation/test_auth.py

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
from nacl.exceptions import CryptoError
from signedjson.types import SigningKey, VerifyKey
from unpaddedbase64 import decode_base64, encode_base64

from homeserver.events.canonical import encode_canonical
from homeserver.events.identifiers import is_valid_key_id, is_valid_server_name
from storage.kernel.errors import MatrixError

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 4096

# Values are quoted strings or bare tokens; commas separate parameters.
_PARAM_RE = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*("(?:[^"\\]|\\.)*"|[^,\s]*)\s*(?:,|$)')


class XMatrixError(Exception):
    """An ``X-Matrix`` header that cannot be parsed or does not verify."""


@attrs.frozen(slots=True)
class XMatrixAuth:
    origin: str
    destination: str | None
    key: str
    sig: str


def request_json(method: str, uri: str, origin: str, destination: str, content: Any | None) -> dict[str, Any]:
    obj: dict[str, Any] = {"method": method.upper(), "uri": uri, "origin": origin, "destination": destination}
    if content is not None:
        obj["content"] = content
    return obj


def request_message(method: str, uri: str, origin: str, destination: str, content: bytes | None) -> bytes:
    """The canonical JSON of ``request_json(...)``, given the content already as canonical JSON
    bytes: they are joined in, not decoded and encoded again (the keys are written in their
    canonical order: content, destination, method, origin, uri)."""
    opening = (b"{",) if content is None else (b'{"content":', content, b",")
    return b"".join((
        *opening,
        b'"destination":', encode_canonical(destination),
        b',"method":', encode_canonical(method.upper()),
        b',"origin":', encode_canonical(origin),
        b',"uri":', encode_canonical(uri), b"}",
    ))


def sign_request(
    method: str, uri: str, origin: str, destination: str, content: Any | None, signing_key: SigningKey
) -> str:
    """The ``Authorization`` header value for one outbound request."""
    encoded = None if content is None else encode_canonical(content)
    return sign_encoded_request(method, uri, origin, destination, encoded, signing_key)


def sign_encoded_request(
    method: str, uri: str, origin: str, destination: str, content: bytes | None, signing_key: SigningKey
) -> str:
    """``sign_request`` for content given as its canonical JSON bytes (the body as sent)."""
    message = request_message(method, uri, origin, destination, content)
    signature = encode_base64(signing_key.sign(message).signature)
    key_id = f"{signing_key.alg}:{signing_key.version}"
    return f'X-Matrix origin="{origin}",destination="{destination}",key="{key_id}",sig="{signature}"'


def parse_x_matrix(header: str) -> XMatrixAuth:
    """Parse ``X-Matrix origin=...,destination=...,key="...",sig="..."``."""
    if len(header) > MAX_HEADER_BYTES:
        raise XMatrixError(f"Authorization header is {len(header)} bytes, over {MAX_HEADER_BYTES}")
    scheme, _, rest = header.partition(" ")
    if scheme != "X-Matrix":
        raise XMatrixError(f"expected the X-Matrix scheme, got {scheme[:20]!r}")
    params: dict[str, str] = {}
    pos = 0
    rest = rest.strip()
    while pos < len(rest):
        match = _PARAM_RE.match(rest, pos)
        if match is None or match.end() == pos:
            raise XMatrixError(f"cannot parse X-Matrix parameters at {rest[pos:pos + 40]!r}")
        value = match.group(2)
        if value.startswith('"'):
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        params[match.group(1).lower()] = value
        pos = match.end()
    for name in ("origin", "key", "sig"):
        if not params.get(name):
            raise XMatrixError(f"X-Matrix header has no {name}")
    # The origin and destination are checked by the server-name grammar here, before any key
    # lookup can try to reach them (a 64-character DNS label is refused at once, not after a
    # lookup times out); key IDs by the spec's "algorithm:identifier" of [a-zA-Z0-9_].
    for name in ("origin", "destination"):
        if name in params and not is_valid_server_name(params[name]):
            raise XMatrixError(f"X-Matrix {name} {params[name][:100]!r} is not a valid server name")
    if not is_valid_key_id(params["key"]):
        raise XMatrixError(f"X-Matrix key {params['key'][:100]!r} is not a key ID (algorithm:identifier)")
    return XMatrixAuth(params["origin"], params.get("destination"), params["key"], params["sig"])


def verify_request_signature(
    auth: XMatrixAuth, method: str, uri: str, destination: str, content: Any | None, verify_key: VerifyKey,
    *, raw_content: bytes | None = None,
) -> None:
    """Raise ``XMatrixError`` unless ``auth.sig`` signs this request for ``destination``.

    ``raw_content``: the body as it came, of which ``content`` is the strict parse. Senders
    send the canonical JSON they signed, so the signed message is first made by joining the body
    in as it is (``request_message``), not by encoding ``content`` again: a 50-PDU
    transaction is 30 kB of JSON. Only where that does not verify (a body sent in another
    spelling) is ``content`` encoded canonically, as the spec says, and checked again. Both are
    the origin's signature over a text whose one parse is this request, the body being a single
    JSON value with unique keys (docs/federation.md, "Request authentication")."""
    if auth.destination is not None and auth.destination != destination:
        raise XMatrixError(f"request is for destination {auth.destination!r}, this server is {destination!r}")
    try:
        signature = decode_base64(auth.sig)
    except (ValueError, TypeError) as e:
        raise XMatrixError(f"signature by {auth.origin} {auth.key} does not verify: {type(e).__name__}") from None
    if raw_content is not None and content is not None:
        try:
            verify_key.verify(request_message(method, uri, auth.origin, destination, raw_content), signature)
            return
        except (CryptoError, ValueError, TypeError):
            pass  # another spelling of the body than the one signed: the canonical one next
    try:
        # A body whose entries are judged one by one (a transaction's PDUs) may hold a value
        # canonical JSON cannot encode (an overflowed float, a lone surrogate): no such spelling.
        message = encode_canonical(request_json(method, uri, auth.origin, destination, content))
    except ValueError as e:  # UnicodeEncodeError included
        raise XMatrixError(f"signature by {auth.origin} {auth.key} does not verify over the body as sent, "
                           f"and the body has no canonical JSON: {type(e).__name__}") from None
    try:
        verify_key.verify(message, signature)
    except (CryptoError, ValueError, TypeError) as e:
        raise XMatrixError(f"signature by {auth.origin} {auth.key} does not verify: {type(e).__name__}") from None


KeyLookup = Callable[[str, str], Awaitable[VerifyKey | None]]
"""``(server_name, key_id) -> key``, or None when the key cannot be found."""


async def authenticate_request(
    header_values: Sequence[bytes] | None,
    method: str,
    uri: str,
    our_name: str,
    content: Any | None,
    lookup_key: KeyLookup,
    *,
    raw_content: bytes | None = None,
) -> str:
    """The verified origin of a request; ``401 M_UNAUTHORIZED`` on any failure. ``raw_content``:
    the body as received (``verify_request_signature``)."""
    if not header_values:
        raise MatrixError(401, "M_UNAUTHORIZED", "Missing X-Matrix Authorization header")
    failure = "no X-Matrix Authorization header"
    for raw in header_values:
        try:
            auth = parse_x_matrix(raw.decode("utf-8"))
            try:
                key = await lookup_key(auth.origin, auth.key)
            except Exception as e:  # a remote failure: the key is unknown to us
                logger.warning("could not fetch key %s of %s: %s", auth.key, auth.origin, e)
                key = None
            if key is None:
                raise XMatrixError(f"key {auth.key} of {auth.origin} is not known")
            verify_request_signature(auth, method, uri, our_name, content, key, raw_content=raw_content)
            return auth.origin
        except (XMatrixError, UnicodeDecodeError) as e:
            failure = str(e)
    logger.warning("rejected a federation request %s %s: %s", method, uri.split("?")[0], failure)
    raise MatrixError(401, "M_UNAUTHORIZED", failure)
