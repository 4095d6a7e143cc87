"""``make interop``: Tributary and a real Synapse federating on loopback, checked through the client APIs.

Story: Sam on Synapse makes a public room ``#interop-N:localhost:SPORT`` and talks in
it; Tom on Tributary joins it by alias, and each sees the other's messages in
``/sync``; Tom back-paginates Sam's messages from before he joined (backfill from
Synapse). Then the other way: Tom makes a room on Tributary and invites Sam; Sam
accepts; they chat, and Sam back-paginates Tom's earlier messages (backfill from
Tributary).

Usage (``make interop`` does this, with the Synapse virtualenv it builds)::

    .venv/bin/python -m tests.interop.run_interop --synapse-python .venv-synapse/bin/python

Prints ``PASS``/``FAIL`` per step with its duration (a failure ends its scenario),
exits 1 if any step failed, and keeps the working directory (configs, logs,
databases) when one did.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import psycopg2

from tests.harness import TributaryProcess
from tests.interop.matrix_client import MatrixUser
from tests.interop.synapse import SynapseProcess

PG_ADMIN_DSN = os.environ.get("TRIBUTARY_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")


class StepSkipped(Exception):
    """A step failed (and was reported): the rest of its scenario is not run."""


@attrs.define
class Report:
    """PASS/FAIL per step, printed as it goes."""

    results: list[tuple[str, str, float]] = attrs.field(factory=list)

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Time the block; a failure is printed with its reason and re-raised as StepSkipped
        so the rest of the scenario is skipped."""
        started = time.monotonic()
        try:
            yield
        except StepSkipped:
            raise
        except Exception as e:  # the report is the adapter: any failure becomes a FAIL line
            detail = "".join(traceback.format_exception_only(type(e), e)).strip()
            self._record("FAIL", name, time.monotonic() - started, detail)
            raise StepSkipped(name) from e
        self._record("PASS", name, time.monotonic() - started, "")

    def _record(self, outcome: str, name: str, seconds: float, detail: str) -> None:
        self.results.append((outcome, name, seconds))
        print(f"{outcome} [{seconds:6.2f}s] {name}", flush=True)
        for line in detail.splitlines():
            print(f"       {line}", flush=True)

    @property
    def failed(self) -> bool:
        return any(outcome != "PASS" for outcome, _, _ in self.results)


@contextmanager
def scratch_database() -> Iterator[str | None]:
    """A new, empty PostgreSQL database (Tributary migrates it), dropped on exit; None (Tributary's
    embedded database) when the server at TRIBUTARY_TEST_POSTGRES is not reachable."""
    try:
        conn = psycopg2.connect(PG_ADMIN_DSN, connect_timeout=5)
    except psycopg2.OperationalError:
        print(f"note: PostgreSQL not reachable at {PG_ADMIN_DSN}; Tributary uses its embedded database")
        yield None
        return
    conn.autocommit = True
    name = f"tributary_interop_{uuid.uuid4().hex[:12]}"
    with conn.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN_DSN.rpartition("/")[0] + "/" + name
    finally:
        with conn.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()


def event_bodies(events: list[dict[str, Any]]) -> list[str]:
    return [e["content"]["body"] for e in events
            if e.get("type") == "m.room.message" and isinstance(e.get("content", {}).get("body"), str)]


def back_paginate(user: MatrixUser, room_id: str, wanted: list[str], *, deadline_s: float = 30.0) -> list[str]:
    """Page ``/messages`` backwards from the user's sync position until every body of
    ``wanted`` is seen or the start of the room; retry from the top until ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while True:
        seen: list[str] = []
        token: str | None = user.since
        for _ in range(20):
            page = user.messages(room_id, start=token, limit=50)
            seen += event_bodies(page.get("chunk", []))
            if set(wanted) <= set(seen) or not page.get("chunk") or page.get("end") in (None, token):
                break
            token = page["end"]
        if set(wanted) <= set(seen):
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"{user.user_id}'s /messages never showed {sorted(set(wanted) - set(seen))} "
                                 f"in {room_id} within {deadline_s:.0f}s (saw {seen})")
        time.sleep(0.5)


def _version_fields(room_version: str | None) -> dict[str, str]:
    return {} if room_version is None else {"room_version": room_version}


def _version_tag(room_version: str | None) -> str:
    return "default version" if room_version is None else f"v{room_version}"


def scenario_join_synapse_room_by_alias(report: Report, sam: MatrixUser, tom: MatrixUser, synapse_name: str,
                                        room_version: str | None) -> None:
    """Synapse hosts a public room; the Tributary user joins it by alias; chat both ways; backfill."""
    tag = f"synapse room ({_version_tag(room_version)})"
    alias_local = f"interop-{uuid.uuid4().hex[:8]}"
    alias = f"#{alias_local}:{synapse_name}"
    history = [f"sam before tom {i}" for i in range(5)]
    with report.step(f"{tag}: Synapse user creates public room {alias} and talks"):
        room_id = sam.create_room(preset="public_chat", room_alias_name=alias_local, name="Interop (Synapse)",
                                  **_version_fields(room_version))
        for body in history:
            sam.send_text(room_id, body)
        sam.sync_until_bodies(room_id, history)
        print(f"       {room_id}, room version {sam.room_version(room_id)}", flush=True)
    with report.step(f"{tag}: Tributary user joins by alias (POST /join/{alias})"):
        joined = tom.join(alias)
        assert joined == room_id, f"joined {joined}, the alias names {room_id}"
    with report.step(f"{tag}: Synapse -> Tributary message appears in Tributary /sync"):
        sam.send_text(room_id, "hello tom, from synapse")
        tom.sync_until_bodies(room_id, ["hello tom, from synapse"])
    with report.step(f"{tag}: Tributary -> Synapse message appears in Synapse /sync"):
        tom.send_text(room_id, "hello sam, from tributary")
        sam.sync_until_bodies(room_id, ["hello sam, from tributary"])
    with report.step(f"{tag}: both /syncs show the whole conversation"):
        tom.sync_until_bodies(room_id, ["hello tom, from synapse", "hello sam, from tributary"])
        sam.sync_until_bodies(room_id, [*history, "hello tom, from synapse", "hello sam, from tributary"])
    with report.step(f"{tag}: Tributary user back-paginates pre-join history (/messages -> backfill)"):
        seen = back_paginate(tom, room_id, history)
        ordered = [b for b in seen if b in history]
        assert ordered == list(reversed(history)), f"history out of order: {ordered}"


def scenario_invite_synapse_user(report: Report, sam: MatrixUser, tom: MatrixUser, room_version: str | None) -> None:
    """Tributary hosts a room and invites the Synapse user, who joins; chat both ways; backfill."""
    tag = f"tributary room ({_version_tag(room_version)})"
    history = [f"tom before sam {i}" for i in range(5)]
    with report.step(f"{tag}: Tributary user creates a room and talks"):
        room_id = tom.create_room(preset="private_chat", name="Interop (Tributary)", **_version_fields(room_version))
        for body in history:
            tom.send_text(room_id, body)
        tom.sync_until_bodies(room_id, history)
        print(f"       {room_id}, room version {tom.room_version(room_id)}", flush=True)
    with report.step(f"{tag}: Tributary user invites the Synapse user"):
        tom.invite(room_id, sam.user_id)
    with report.step(f"{tag}: invite appears in Synapse /sync"):
        sam.sync_until_invited(room_id)
    with report.step(f"{tag}: Synapse user joins (POST /join/{{roomId}})"):
        joined = sam.join(room_id)
        assert joined == room_id, f"joined {joined}, expected {room_id}"
    with report.step(f"{tag}: Tributary -> Synapse message appears in Synapse /sync"):
        tom.send_text(room_id, "welcome sam, from tributary")
        sam.sync_until_bodies(room_id, ["welcome sam, from tributary"])
    with report.step(f"{tag}: Synapse -> Tributary message appears in Tributary /sync"):
        sam.send_text(room_id, "thanks tom, from synapse")
        tom.sync_until_bodies(room_id, ["thanks tom, from synapse"])
    with report.step(f"{tag}: both /syncs show the whole conversation"):
        tom.sync_until_bodies(room_id, [*history, "welcome sam, from tributary", "thanks tom, from synapse"])
        sam.sync_until_bodies(room_id, ["welcome sam, from tributary", "thanks tom, from synapse"])
    with report.step(f"{tag}: Synapse user back-paginates pre-join history (/messages -> backfill)"):
        seen = back_paginate(sam, room_id, history)
        ordered = [b for b in seen if b in history]
        assert ordered == list(reversed(history)), f"history out of order: {ordered}"


def scenario_invited_by_synapse(report: Report, sam: MatrixUser, tom: MatrixUser, room_version: str | None) -> None:
    """Synapse hosts a private room and invites the Tributary user: the invite reaches Tributary's
    /sync before Tributary is in the room (invite_room_state), then Tom joins by room ID."""
    tag = f"synapse invites ({_version_tag(room_version)})"
    with report.step(f"{tag}: Synapse user creates a private room and invites the Tributary user"):
        room_id = sam.create_room(preset="private_chat", name="Interop (invite)", **_version_fields(room_version))
        sam.send_text(room_id, "before the invite")
        sam.invite(room_id, tom.user_id)
    with report.step(f"{tag}: invite appears in Tributary /sync"):
        tom.sync_until_invited(room_id)
        assert room_id not in tom.joined
    with report.step(f"{tag}: Tributary user joins (POST /join/{{roomId}}) and the two talk"):
        joined = tom.join(room_id)
        assert joined == room_id, f"joined {joined}, expected {room_id}"
        tom.send_text(room_id, "thanks for the invite, from tributary")
        sam.sync_until_bodies(room_id, ["thanks for the invite, from tributary"])


def run_scenario(scenario: Callable[[], None]) -> None:
    try:
        scenario()
    except StepSkipped:
        pass  # already reported; the next scenario is independent


TRACEBACK = re.compile(r"^Traceback \(most recent call last\):", re.MULTILINE)
# Synapse's log format: "date time,ms - logger - line - LEVEL - context - message".
SYNAPSE_COMPLAINT = re.compile(r"^\S+ \S+ - (?P<logger>\S+) - \d+ - (?:WARNING|ERROR|CRITICAL) - ")
# Warnings Synapse always logs: its start-up banner.
SYNAPSE_BENIGN_LOGGERS = frozenset({"synapse.config.logger"})


def synapse_complaints(log: str) -> list[str]:
    """Synapse's WARNING and worse lines, less its start-up banner. Synapse reports much of
    what it dislikes about a peer's requests only here (it may still answer 200)."""
    return [line for line in log.splitlines()
            if (m := SYNAPSE_COMPLAINT.match(line)) and m["logger"] not in SYNAPSE_BENIGN_LOGGERS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synapse-python", type=Path, required=True,
                        help="python of the virtualenv matrix-synapse is installed in")
    parser.add_argument("--room-versions", nargs="+", default=["default", "10"], metavar="VERSION",
                        help="room versions to run both scenarios in ('default': each creator's default)")
    parser.add_argument("--keep", action="store_true", help="keep the working directory even when all steps pass")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="tributary-interop-"))
    report = Report()
    tributary: TributaryProcess | None = None
    synapse: SynapseProcess | None = None
    print(f"working directory: {workdir}", flush=True)
    with scratch_database() as database_url:
        try:
            try:
                with report.step("synapse: generate config"):
                    synapse = SynapseProcess.configure(args.synapse_python.absolute(), workdir / "synapse")
                    print(f"       matrix-synapse {synapse.version()}, server name {synapse.server_name}", flush=True)
                with report.step("tributary: start"):
                    (workdir / "tributary").mkdir()
                    tributary = TributaryProcess.configure_federating(workdir / "tributary", database_url=database_url)
                    tributary.start(timeout=60)
                    print(f"       server name {tributary.server_name}", flush=True)
                with report.step("synapse: start"):
                    synapse.start()
                sam, tom = MatrixUser(synapse.base_url), MatrixUser(tributary.base_url)
                with report.step("register @sam on Synapse and @tom on Tributary"):
                    sam.register("sam", "interop-password-sam")
                    tom.register("tom", "interop-password-tom")
                    sam.sync_once(timeout_ms=0)
                    tom.sync_once(timeout_ms=0)
            except StepSkipped:
                return _finish(report, workdir, tributary, synapse, keep=args.keep)
            syn_name = synapse.server_name
            for version in args.room_versions:
                room_version = None if version == "default" else version
                run_scenario(lambda: scenario_join_synapse_room_by_alias(report, sam, tom, syn_name, room_version))
                run_scenario(lambda: scenario_invite_synapse_user(report, sam, tom, room_version))
                run_scenario(lambda: scenario_invited_by_synapse(report, sam, tom, room_version))
            return _finish(report, workdir, tributary, synapse, keep=args.keep)
        finally:
            # Only after an unexpected error (Ctrl-C, a bug here): _finish stops them otherwise.
            for process in (tributary, synapse):
                if process is not None and process.process is not None and process.process.poll() is None:
                    process.stop()


def _finish(report: Report, workdir: Path, tributary: TributaryProcess | None, synapse: SynapseProcess | None,
            *, keep: bool) -> int:
    """Stop both servers, check they stopped cleanly, print the summary; the exit code."""
    if tributary is not None and tributary.process is not None:
        try:
            with report.step("tributary: clean stop, no tracebacks in its log"):
                code = tributary.stop()
                assert code == 0, f"exit code {code}"
                count = len(TRACEBACK.findall(tributary.output))
                assert count == 0, f"{count} traceback(s) in {tributary.log_path}"
        except StepSkipped:
            pass
    if synapse is not None and synapse.process is not None:
        try:
            with report.step("synapse: clean stop"):
                synapse_code = synapse.stop()
                assert synapse_code == 0, f"exit code {synapse_code}"
        except StepSkipped:
            pass
        try:
            with report.step("synapse: no warnings or errors in its log"):
                complaints = synapse_complaints(synapse.log_path.read_text(encoding="utf-8", errors="replace"))
                assert not complaints, "\n".join([f"{len(complaints)} line(s) in {synapse.log_path}:",
                                                   *(line[:600] for line in complaints[:10])])
        except StepSkipped:
            pass
    passed = sum(1 for outcome, _, _ in report.results if outcome == "PASS")
    total = sum(seconds for _, _, seconds in report.results)
    print(f"\n{passed}/{len(report.results)} steps passed in {total:.1f}s", flush=True)
    if report.failed or keep:
        print(f"logs kept in {workdir}:")
        if tributary is not None:
            print(f"  tributary: {tributary.log_path}")
        if synapse is not None:
            print(f"  synapse:   {synapse.log_path} (console: {synapse.console_path})")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    print("INTEROP " + ("FAILED" if report.failed else "PASSED"), flush=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
