"""``make interop``: Tributary and a real Synapse federating on loopback, checked through the client APIs.

Story: Sam on Synapse makes a public room ``#interop-N:localhost:SPORT`` and talks in
it; Tom on Tributary joins it by alias, and each sees the other's messages in
``/sync``; Tom back-paginates Sam's messages from before he joined (backfill from
Synapse). Then the other way: Tom makes a room on Tributary and invites Sam; Sam
accepts; they chat, and Sam back-paginates Tom's earlier messages (backfill from
Tributary). Media: Sam's image is downloaded (and thumbnailed) by Tom through Tributary, and
Tom's through Synapse by Sam, byte for byte. Then an encrypted DM with matrix-nio's encryption on both sides
(``tests/interop/e2e_dm.py``): keys, claims and room keys across the two servers, a
second device, a verification request. Then knocks, restricted joins and room upgrades
both ways: each server's user upgrades a room the other server's user is in, who follows
the tombstone into the new room and talks there. Room directory: each side publishes a room, and the
other lists it through its own server (``/publicRooms?server=``, federation ``/publicRooms``).

Usage (``make interop`` does this, with the Synapse virtualenv it builds)::

    .venv/bin/python -m tests.interop.run_interop --synapse-python .venv-synapse/bin/python

Prints ``PASS``/``FAIL`` per step with its duration (a failure ends its scenario),
exits 1 if any step failed, and keeps the working directory (configs, logs,
databases) when one did.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import psycopg2

from tests.harness import TributaryProcess
from tests.interop.e2e_dm import encrypted_dm
from tests.interop.matrix_client import MatrixApiError, MatrixUser
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


KNOCK_RULE = [{"type": "m.room.join_rules", "state_key": "", "content": {"join_rule": "knock"}}]


def scenario_knocks(report: Report, host: MatrixUser, guest: MatrixUser, host_name: str, host_label: str) -> None:
    """``host`` makes a room with the knock join rule; ``guest`` (on the other server) knocks
    (make_knock/send_knock), sees it under rooms.knock; the host sees the knock, accepts it
    with an invite, and the guest joins and talks."""
    tag = f"knock on a {host_label} room"
    with report.step(f"{tag}: created with the knock join rule, the other server's user knocks"):
        room_id = host.create_room(name=f"Interop knock ({host_label})", initial_state=KNOCK_RULE)
        knocked = guest.knock(room_id, via=[host_name])
        assert knocked == room_id, f"knocked on {knocked}, expected {room_id}"
    with report.step(f"{tag}: the knock appears in the knocker's /sync (rooms.knock) and the host's state"):
        guest.sync_until_knocked(room_id)
        host.wait_for_membership(room_id, guest.user_id, "knock")
    with report.step(f"{tag}: the host accepts (invite), the knocker joins and talks"):
        host.invite(room_id, guest.user_id)
        guest.sync_until_invited(room_id)
        assert guest.join(room_id, via=[host_name]) == room_id
        guest.send_text(room_id, f"let in by knocking ({host_label})")
        host.sync_until_bodies(room_id, [f"let in by knocking ({host_label})"])


def scenario_restricted_join(report: Report, host: MatrixUser, guest: MatrixUser, host_name: str,
                             host_label: str) -> None:
    """``host`` makes a public room S and a room R restricted to S's members; ``guest`` joins S,
    then R: the host's server names its user as join_authorised_via_users_server and signs."""
    tag = f"restricted {host_label} room"
    with report.step(f"{tag}: the other server's user joins the allowed room, then the restricted one"):
        space = host.create_room(preset="public_chat", name=f"Interop space ({host_label})")
        rule = {"join_rule": "restricted", "allow": [{"type": "m.room_membership", "room_id": space}]}
        room_id = host.create_room(name=f"Interop restricted ({host_label})",
                                   initial_state=[{"type": "m.room.join_rules", "state_key": "", "content": rule}])
        assert guest.join(space, via=[host_name]) == space
        assert guest.join(room_id, via=[host_name]) == room_id
    with report.step(f"{tag}: the join is authorised by the host's user, and the two talk"):
        host.wait_for_membership(room_id, guest.user_id, "join")
        member = host.request("GET", f"/_matrix/client/v3/rooms/{urllib.parse.quote(room_id)}/state/"
                                     f"m.room.member/{urllib.parse.quote(guest.user_id)}")
        assert member.get("join_authorised_via_users_server") == host.user_id, member
        guest.send_text(room_id, f"joined through the space ({host_label})")
        host.sync_until_bodies(room_id, [f"joined through the space ({host_label})"])


def scenario_upgrade(report: Report, host: MatrixUser, guest: MatrixUser, host_name: str, host_label: str,
                     old_version: str, new_version: str) -> None:
    """``host`` upgrades a public room of ``old_version`` shared with ``guest`` (the other
    server's user): the guest sees the tombstone in the old room, follows ``replacement_room``
    (its create event names the old room as ``predecessor``), joins and talks there."""
    tag = f"upgrade of a {host_label} room {old_version} -> {new_version}"
    quote = urllib.parse.quote
    with report.step(f"{tag}: the other server's user joins the old room, the host upgrades it"):
        room_id = host.create_room(preset="public_chat", name=f"Interop upgrade ({host_label})",
                                   room_version=old_version)
        assert guest.join(room_id, via=[host_name]) == room_id
        host.wait_for_membership(room_id, guest.user_id, "join")
        upgraded = host.request("POST", f"/_matrix/client/v3/rooms/{quote(room_id)}/upgrade",
                                {"new_version": new_version}, timeout=120.0)
        new_room = str(upgraded["replacement_room"])
    with report.step(f"{tag}: the tombstone reaches the other server, which follows it"):
        deadline = time.monotonic() + 30.0
        while True:
            try:
                tombstone = guest.request("GET", f"/_matrix/client/v3/rooms/{quote(room_id)}/state/m.room.tombstone/")
                break
            except MatrixApiError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert tombstone.get("replacement_room") == new_room, tombstone
        assert guest.join(new_room, via=[host_name]) == new_room
        assert guest.room_version(new_room) == new_version
        create = guest.request("GET", f"/_matrix/client/v3/rooms/{quote(new_room)}/state/m.room.create/")
        assert create.get("predecessor", {}).get("room_id") == room_id, create
    with report.step(f"{tag}: the two talk in the new room"):
        guest.send_text(new_room, f"followed the tombstone ({host_label})")
        host.sync_until_bodies(new_room, [f"followed the tombstone ({host_label})"])


def scenario_public_rooms(report: Report, host: MatrixUser, reader: MatrixUser, host_name: str,
                          host_label: str, reader_label: str) -> None:
    """``host`` publishes a room in its directory; ``reader`` lists it through its own server
    (``/publicRooms?server=``, the federation ``/publicRooms``), also by a search term."""
    name = f"Interop directory {uuid.uuid4().hex[:8]}"
    tag = f"room directory of {host_label}"
    with report.step(f"{tag}: {host_label} user creates and publishes {name!r}"):
        room_id = host.create_room(preset="public_chat", visibility="public", name=name, topic="listed")
    with report.step(f"{tag}: {reader_label} user lists it with GET /publicRooms?server={host_name}"):
        deadline = time.monotonic() + 30.0
        while True:
            listed = reader.request(
                "GET", f"/_matrix/client/v3/publicRooms?server={urllib.parse.quote(host_name)}&limit=100")
            entries = {entry["room_id"]: entry for entry in listed.get("chunk", [])}
            if room_id in entries or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert room_id in entries, f"{room_id} not in {sorted(entries)}"
        assert entries[room_id].get("name") == name and entries[room_id].get("topic") == "listed", entries[room_id]
        assert entries[room_id].get("num_joined_members") == 1, entries[room_id]
    with report.step(f"{tag}: {reader_label} user finds it with POST /publicRooms (generic_search_term)"):
        found = reader.request("POST", f"/_matrix/client/v3/publicRooms?server={urllib.parse.quote(host_name)}",
                               {"limit": 10, "filter": {"generic_search_term": name.split()[-1]}})
        assert [entry["room_id"] for entry in found["chunk"]] == [room_id], found


def _png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _png_size(data: bytes) -> tuple[int, int]:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.size


def scenario_media(report: Report, sam: MatrixUser, tom: MatrixUser) -> None:
    """Each server's user uploads an image; the other's user downloads it through their own
    server (federation media: authenticated, or the legacy fallback), byte for byte."""
    sam_png, tom_png = _png(320, 200, (200, 40, 40)), _png(240, 180, (40, 40, 200))
    with report.step("media: Synapse user's image downloaded through Tributary"):
        mxc = sam.upload(sam_png, "image/png", "sam.png")
        headers, body = tom.download(mxc)
        assert body == sam_png, f"got {len(body)} bytes, uploaded {len(sam_png)}"
        assert headers.get("content-type", "").startswith("image/png"), headers
    with report.step("media: thumbnail of the Synapse user's image through Tributary"):
        headers, body = tom.thumbnail(mxc, 96, 96, "crop")
        assert _png_size(body) == (96, 96), _png_size(body)
    with report.step("media: Tributary user's image downloaded through Synapse"):
        mxc = tom.upload(tom_png, "image/png", "tom.png")
        headers, body = sam.download(mxc)
        assert body == tom_png, f"got {len(body)} bytes, uploaded {len(tom_png)}"
        assert headers.get("content-type", "").startswith("image/png"), headers
    with report.step("media: thumbnail of the Tributary user's image through Synapse"):
        headers, body = sam.thumbnail(mxc, 32, 32, "crop")
        assert headers.get("content-type", "").startswith("image/"), headers
        assert max(_png_size(body)) <= 64, _png_size(body)


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
    parser.add_argument("--room-versions", nargs="+", default=["default", "1", "6", "9", "10", "11"], metavar="VERSION",
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
            run_scenario(lambda: scenario_media(report, sam, tom))
            tributary_url, synapse_url = tributary.base_url, synapse.base_url
            run_scenario(lambda: asyncio.run(encrypted_dm(
                report.step, synapse_url=synapse_url, tributary_url=tributary_url,
                sam=(sam.user_id, "interop-password-sam"), tom=(tom.user_id, "interop-password-tom"),
                workdir=workdir / "nio")))
            for version in args.room_versions:
                room_version = None if version == "default" else version
                run_scenario(lambda: scenario_join_synapse_room_by_alias(report, sam, tom, syn_name, room_version))
                run_scenario(lambda: scenario_invite_synapse_user(report, sam, tom, room_version))
                run_scenario(lambda: scenario_invited_by_synapse(report, sam, tom, room_version))
            trib_name = tributary.server_name
            run_scenario(lambda: scenario_knocks(report, sam, tom, syn_name, "Synapse"))
            run_scenario(lambda: scenario_knocks(report, tom, sam, trib_name, "Tributary"))
            run_scenario(lambda: scenario_restricted_join(report, sam, tom, syn_name, "Synapse"))
            run_scenario(lambda: scenario_restricted_join(report, tom, sam, trib_name, "Tributary"))
            run_scenario(lambda: scenario_upgrade(report, tom, sam, trib_name, "Tributary", "1", "12"))
            run_scenario(lambda: scenario_upgrade(report, sam, tom, syn_name, "Synapse", "10", "12"))
            run_scenario(lambda: scenario_public_rooms(report, sam, tom, syn_name, "Synapse", "Tributary"))
            run_scenario(lambda: scenario_public_rooms(report, tom, sam, trib_name, "Tributary", "Synapse"))
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
