# tests: docs/replication.md
"""docs/replication.md is checked against the code, so it cannot drift.

Every wire line in a ```replication block parses (and is sent by a side the
TCP rules allow), the constants table and every duration in the page match the
code's constants, and the command and transition tables are the code's tables.
(Synapse's own doc says 15 s where its code used 25 s; this is the test that
would have caught it.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import replication.commands as commands
import replication.connection as connection
from replication.commands import COMMAND_TYPES, parse_line
from replication.connection import TCP_RULES, TRANSITIONS, Role
from replication.errors import CommandParseError

DOC = Path(__file__).resolve().parents[3] / "docs" / "replication.md"


def _doc() -> str:
    return DOC.read_text(encoding="utf-8")


def _replication_blocks() -> list[list[str]]:
    return [block.split("\n") for block in re.findall(r"```replication\n(.*?)```", _doc(), re.DOTALL)]


def _wire_lines() -> list[tuple[Role, str]]:
    lines = []
    for block in _replication_blocks():
        for line in block:
            if line.startswith("> "):
                lines.append((Role.SERVER, line[2:]))
            elif line.startswith("< "):
                lines.append((Role.CLIENT, line[2:]))
            else:
                assert line == "" or line.startswith("# "), f"not a wire line or comment: {line!r}"
    return lines


def _table_rows(heading: str) -> list[list[str]]:
    """The rows of the first Markdown table whose header starts with ``heading``."""
    rows: list[list[str]] = []
    found = False
    for line in _doc().split("\n"):
        if line.startswith(heading):
            found = True
            continue
        if found:
            if not line.startswith("|"):
                if rows:
                    break
                continue
            if set(line) <= set("|- "):
                continue
            cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
            rows.append([cell.strip() for cell in cells])
    assert rows, f"no table under {heading!r}"
    return rows


def test_every_sample_line_parses_and_is_sent_by_an_allowed_side() -> None:
    lines = _wire_lines()
    assert len(lines) > 30
    names = set()
    for role, line in lines:
        command = parse_line(line)
        names.add(command.NAME)
        assert TCP_RULES.may_send(role, command.NAME), f"{role.value} may not send {line!r}"
    assert names == set(COMMAND_TYPES), "every command has an example"


def test_every_command_has_a_section() -> None:
    for name in COMMAND_TYPES:
        assert f"\n### `{name}`\n" in _doc()


def test_command_table_matches_the_tcp_rules() -> None:
    rows = _table_rows("| command | sent by | format |")
    assert [row[0].strip("`") for row in rows] == list(COMMAND_TYPES)
    for name, sent_by, _format in rows:
        name = name.strip("`")
        sides = (("S", Role.SERVER), ("C", Role.CLIENT))
        expected = ", ".join(side for side, role in sides if TCP_RULES.may_send(role, name))
        assert sent_by == expected, name


def test_constants_table_matches_the_code() -> None:
    rows = _table_rows("| setting | constant | default |")
    seen = set()
    for _setting, constant, default in rows:
        name = constant.strip("`")
        value = getattr(connection, name, None)
        if value is None:
            value = getattr(commands, name)
        number = float(default.split()[0].replace(",", ""))
        assert number == value, f"{name}: doc says {default}, code says {value}"
        seen.add(name)
    assert seen >= {"KEEPALIVE_INTERVAL_SECONDS", "PING_TIMEOUT_SECONDS", "MAX_OUTBOUND_BUFFER", "MAX_LINE_LENGTH"}


def test_every_duration_in_the_doc_is_a_constant() -> None:
    durations = {float(n) for n in re.findall(r"\b(\d+(?:\.\d+)?) ?(?:s|seconds)\b", _doc())}
    assert durations == {connection.KEEPALIVE_INTERVAL_SECONDS, connection.PING_TIMEOUT_SECONDS}


@pytest.mark.parametrize(
    ("module", "name"),
    [
        (commands, "MAX_LINE_LENGTH"),
        (commands, "MAX_INT_CHARS"),
        (commands, "MAX_ROW_DEPTH"),
        (connection, "MAX_OUTBOUND_BUFFER"),
    ],
)
def test_limits_in_the_prose_match_the_code(module: object, name: str) -> None:
    assert f"`{name}` ({getattr(module, name)})" in _doc()


def test_transition_table_is_the_codes() -> None:
    rows = _table_rows("| state | trigger | next state |")
    documented = {(state, trigger): next_state for state, trigger, next_state in rows}
    assert documented == {
        (state.name, trigger.value): next_state.name for (state, trigger), next_state in TRANSITIONS.items()
    }


@pytest.mark.parametrize(
    "line",
    ["RDATA events master abc []", 'LOCK_RELEASED ["master","lock","key"]'],
)
def test_quoted_error_messages_are_the_codes(line: str) -> None:
    with pytest.raises(CommandParseError) as caught:
        parse_line(line)
    quoted = " ".join(_doc().split())  # the doc wraps long quotes
    assert caught.value.message.split("; supported")[0] in quoted
