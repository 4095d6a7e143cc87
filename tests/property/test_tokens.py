"""Tokens for arbitrary vectors: exact round trips, order laws, and only InvalidTokenError on junk."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from storage.tokens import (
    MAX_INSTANCE_ID,
    MAX_POSITION,
    InvalidTokenError,
    MultiWriterStreamToken,
    RoomStreamToken,
    StreamToken,
    SyncStreamKey,
)

positions = st.integers(0, MAX_POSITION) | st.integers(0, 1000)
instance_ids = st.integers(1, MAX_INSTANCE_ID) | st.integers(1, 8)
vectors = st.dictionaries(instance_ids, positions, max_size=4)


@st.composite
def room_tokens(draw: st.DrawFn) -> RoomStreamToken:
    vector = draw(vectors)
    minimum = draw(st.none() | positions)
    if minimum is not None and vector:
        minimum = min(minimum, *vector.values())
    return RoomStreamToken.from_positions(vector, minimum)


@st.composite
def other_tokens(draw: st.DrawFn) -> MultiWriterStreamToken:
    return MultiWriterStreamToken.from_positions(draw(vectors))


sync_tokens = st.builds(
    StreamToken,
    room_tokens(),
    other_tokens(),
    other_tokens(),
    other_tokens(),
    other_tokens(),
    other_tokens(),
    other_tokens(),
)

common = settings(max_examples=150, deadline=None)
#: Composite tokens are seven vectors each: fewer, costlier examples.
composite = settings(max_examples=60, deadline=None)


@common
@given(room_tokens())
def test_room_token_round_trips_exactly(token: RoomStreamToken) -> None:
    text = token.to_string()
    assert RoomStreamToken.parse(text) == token
    assert RoomStreamToken.parse(text).to_string() == text


@common
@given(vectors, st.integers(1, 12))
def test_from_positions_keeps_every_writers_position(vector: dict[int, int], probe: int) -> None:
    token = RoomStreamToken.from_positions(vector)
    for instance_id, position in vector.items():
        assert token.get(instance_id) == position
    assert token.minimum == min(vector.values(), default=0)


@composite
@given(sync_tokens)
def test_sync_token_round_trips_exactly(token: StreamToken) -> None:
    text = str(token)
    assert StreamToken.parse(text) == token
    assert str(StreamToken.parse(text)) == text
    if not any(t.instance_positions for _, t in token.components()):
        # One number per stream: short whatever the positions.
        assert len(text) <= len(SyncStreamKey) * (len(str(MAX_POSITION)) + 1) + 1


@common
@given(room_tokens(), room_tokens(), room_tokens())
def test_order_laws(a: RoomStreamToken, b: RoomStreamToken, c: RoomStreamToken) -> None:
    assert a.is_before_or_equal(a)
    if a.is_before_or_equal(b) and b.is_before_or_equal(a):
        assert a == b
    if a.is_before_or_equal(b) and b.is_before_or_equal(c):
        assert a.is_before_or_equal(c)
    assert a.is_before(b) == (a.is_before_or_equal(b) and a != b)
    assert a.is_after(b) == b.is_before(a)


@common
@given(room_tokens(), room_tokens())
def test_advance_is_the_least_upper_bound(a: RoomStreamToken, b: RoomStreamToken) -> None:
    joined = a.advance(b)
    assert a.is_before_or_equal(joined) and b.is_before_or_equal(joined)
    assert joined == b.advance(a)
    assert joined.advance(a) == joined
    ids = {i for i, _ in a.instance_positions} | {i for i, _ in b.instance_positions} | {1}
    for i in ids:
        assert joined.get(i) == max(a.get(i), b.get(i))


@common
@given(st.text(st.sampled_from("sm~._0123456789-x ")) | st.text(max_size=40))
def test_arbitrary_text_parses_to_its_own_string_or_raises_invalid_token(text: str) -> None:
    for parse in (RoomStreamToken.parse, MultiWriterStreamToken.parse):
        try:
            token = parse(text)
        except InvalidTokenError:
            continue
        assert token.to_string() == text
    try:
        sync = StreamToken.parse(text)
    except InvalidTokenError:
        return
    assert str(sync) == text


@composite
@given(sync_tokens, st.sampled_from(list(SyncStreamKey)), st.integers(0, 2000))
def test_advancing_a_sync_token_component(token: StreamToken, key: SyncStreamKey, position: int) -> None:
    cls = RoomStreamToken if key is SyncStreamKey.EVENTS else MultiWriterStreamToken
    advanced = token.advance(key, cls(position))
    assert token.get(key).is_before_or_equal(advanced.get(key))
    assert advanced.get(key).minimum == max(position, token.get(key).minimum)
    assert advanced.advanced_keys(token) <= {key}


@given(st.sampled_from(["events", "caches"]), st.integers(-(2**63), 2**63 - 1), st.integers(-(2**63), 2**63 - 1))
def test_stream_positions_order_like_their_values_within_a_stream(stream: str, x: int, y: int) -> None:
    from storage.tokens import StreamPosition

    a, b = StreamPosition(stream, x), StreamPosition(stream, y)
    assert (a < b, a <= b, a > b, a >= b, a == b) == (x < y, x <= y, x > y, x >= y, x == y)
