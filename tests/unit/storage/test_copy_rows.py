"""COPY's text format for ``Transaction.copy_rows``: every value a row may hold, and the escapes."""

from __future__ import annotations

import pytest

from storage.database import _copy_value


@pytest.mark.parametrize(("value", "text"), [
    (None, "\\N"), (True, "t"), (False, "f"), (0, "0"), (-42, "-42"), ("", ""), ("plain", "plain"),
    ("tab\there", "tab\\there"), ("line\nbreak\r", "line\\nbreak\\r"), ("back\\slash", "back\\\\slash"),
    ('{"body":"a\\nb"}', '{"body":"a\\\\nb"}'), ("\\N", "\\\\N"), ("é \u2028", "é \u2028"),
])
def test_values_become_copy_text(value: object, text: str) -> None:
    assert _copy_value(value) == text


def test_other_types_are_refused() -> None:
    with pytest.raises(TypeError):
        _copy_value(1.5)
    with pytest.raises(TypeError):
        _copy_value(b"bytes")
