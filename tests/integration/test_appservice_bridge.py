"""A real bridge: heisenbridge (from PyPI, an IRC bridge on the mautrix framework) between
Tributary and Debian's ngIRCd, all on loopback (``make services`` installs both:
.ci/install-bridge.sh).

Alice, a Matrix user, invites the bridge's bot to a direct chat, which becomes her control
room; she adds the IRC network, connects to it, and opens a private chat with Bob, a plain
IRC client written here. What she says reaches Bob on IRC; what Bob says reaches her room, sent
by the bridge's puppet of him (a user of its exclusive namespace).
"""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml
from prometheus_client import CollectorRegistry
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.protocol import Factory
from twisted.protocols.basic import LineOnlyReceiver

from homeserver.app import HomeServer
from homeserver.config import parse_config
from tests.harness import REPO_ROOT, free_port
from tests.integration.test_client_support import GENEROUS, SERVER_NAME, Client, server_config
from tests.integration.test_push import _sleep, wait_for
from tests.twisted_plugin import reactor

HEISENBRIDGE = REPO_ROOT / ".venv-heisenbridge" / "bin" / "heisenbridge"
BOT = f"@heisenbridge:{SERVER_NAME}"


class IrcUser(LineOnlyReceiver):
    """Bob on IRC: registers, answers PINGs, remembers every line."""

    delimiter = b"\r\n"

    def __init__(self) -> None:
        self.lines: list[str] = []

    def connectionMade(self) -> None:
        self.send("NICK bob")
        self.send("USER bob 0 * :Bob")

    def send(self, line: str) -> None:
        self.sendLine(line.encode())

    def lineReceived(self, line: bytes) -> None:
        text = line.decode("utf-8", "replace")
        if text.startswith("PING"):
            self.send("PONG" + text[4:])
        self.lines.append(text)

    def saw(self, fragment: str) -> bool:
        return any(fragment in line for line in self.lines)


@contextmanager
def process(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def ngircd_config(tmp_path: Path, port: int) -> Path:
    path = tmp_path / "ngircd.conf"
    path.write_text(
        "[Global]\nName = irc.test.local\nInfo = Tributary bridge test\nListen = 127.0.0.1\n"
        f"Ports = {port}\nMotdPhrase = hello\nPidFile = {tmp_path / 'ngircd.pid'}\n"
        "[Options]\nPAM = no\nIdent = no\nDNS = no\n"
    )
    return path


async def ok(client: Client, method: str, path: str, body: Any = None, *, token: str) -> Any:
    response = await client.request(method, path, body, token=token)
    assert response.status == 200, (method, path, response)
    return response.body


async def test_a_matrix_user_and_an_irc_user_talk_through_heisenbridge(database_dsn: str, tmp_path: Path) -> None:
    assert HEISENBRIDGE.exists(), "heisenbridge is not installed: run `make services` (.ci/install-bridge.sh)"
    irc_port, bridge_port = free_port(), free_port()
    registration = tmp_path / "heisenbridge.yaml"
    registration.write_text(yaml.safe_dump({
        "id": "heisenbridge", "url": f"http://127.0.0.1:{bridge_port}",
        "as_token": secrets.token_hex(16), "hs_token": secrets.token_hex(16),
        "rate_limited": False, "sender_localpart": "heisenbridge",
        "namespaces": {"users": [{"regex": "@irc_.*", "exclusive": True}], "aliases": [], "rooms": []},
    }))
    raw = server_config(database_dsn, tmp_path, rc_message=GENEROUS, rc_joins={"local": GENEROUS, "remote": GENEROUS},
                        app_service_config_files=[str(registration)],
                        app_service_sender={"backoff": {"initial": "200ms", "max": "1s"}})
    config = parse_config(raw, config_path=tmp_path / "homeserver.yaml")
    hs = HomeServer(config, reactor, registry=CollectorRegistry())
    await hs.start()
    base_url = f"http://127.0.0.1:{config.listeners[0].port}"
    client = Client(base_url)
    bridge_log = tmp_path / "heisenbridge.log"
    try:
        with process(["ngircd", "-n", "-f", str(ngircd_config(tmp_path, irc_port))], tmp_path / "ngircd.log"), \
                process([str(HEISENBRIDGE), "-v", "-c", str(registration), "-l", "127.0.0.1", "-p", str(bridge_port),
                         base_url], bridge_log):
            await wait_for(lambda: "bridge is now running" in bridge_log.read_text(), "heisenbridge to start", 60)
            bob = IrcUser()
            await TCP4ClientEndpoint(reactor, "127.0.0.1", irc_port).connect(Factory.forProtocol(lambda: bob))
            await wait_for(lambda: bob.saw(" 001 bob "), "Bob on IRC")

            alice = (await client.register_ok("alice"))["access_token"]
            since: str | None = None

            async def sync() -> dict[str, Any]:
                nonlocal since
                path = "sync?timeout=0" + (f"&since={since}" if since else "")
                body: dict[str, Any] = await ok(client, "GET", path, token=alice)
                since = body["next_batch"]
                return body

            async def next_invite() -> str:
                found: list[str] = []

                async def poll() -> None:
                    found.extend((await sync()).get("rooms", {}).get("invite", {}))

                for _ in range(300):
                    await poll()
                    if found:
                        await ok(client, "POST", f"rooms/{quote(found[0])}/join", {}, token=alice)
                        return found[0]
                    await _sleep(0.1)
                raise AssertionError(f"no invite came; bridge log:\n{bridge_log.read_text()[-3000:]}")

            async def messages(room_id: str) -> list[dict[str, Any]]:
                body = await ok(client, "GET", f"rooms/{quote(room_id)}/messages?dir=b&limit=50", token=alice)
                return [e for e in body["chunk"] if e["type"] == "m.room.message"]

            async def say(room_id: str, text: str) -> None:
                await ok(client, "PUT", f"rooms/{quote(room_id)}/send/m.room.message/{secrets.token_hex(4)}",
                         {"msgtype": "m.text", "body": text}, token=alice)

            async def until_said(room_id: str, fragment: str, sender_prefix: str = BOT) -> dict[str, Any]:
                for _ in range(300):
                    for event in await messages(room_id):
                        if event["sender"].startswith(sender_prefix) and fragment in event["content"].get("body", ""):
                            return event
                    await _sleep(0.1)
                said = [(e["sender"], e["content"].get("body")) for e in await messages(room_id)]
                raise AssertionError(f"nobody said {fragment!r} in {room_id}: {said}\n{bridge_log.read_text()[-3000:]}")

            # Alice invites the bot to a direct chat: it joins, and the room is her control room.
            control = (await ok(client, "POST", "createRoom", {"is_direct": True, "invite": [BOT],
                                                               "preset": "trusted_private_chat"}, token=alice))["room_id"]
            await until_said(control, "")
            await say(control, "ADDNETWORK testnet")
            await until_said(control, "Network added")
            await say(control, f"ADDSERVER testnet 127.0.0.1 {irc_port}")
            await say(control, "OPEN testnet")
            network = await next_invite()
            await say(network, "NICK alice")
            await say(network, "CONNECT")
            for _ in range(120):  # until the bridge's connection for Alice is on the network
                bob.send("ISON alice")
                await _sleep(0.5)
                if bob.saw(" 303 bob :alice"):
                    break
            assert bob.saw(" 303 bob :alice"), f"alice never came on IRC:\n{bridge_log.read_text()[-3000:]}"

            # Matrix -> IRC: a private chat with Bob.
            await say(network, "QUERY bob")
            private = await next_invite()
            await say(private, "hello from matrix")
            await wait_for(lambda: bob.saw("PRIVMSG bob :hello from matrix"), "Alice's message on IRC", 30)
            assert any(line.startswith(":alice!") for line in bob.lines if "hello from matrix" in line)

            # IRC -> Matrix: Bob answers; his puppet says it in Alice's room.
            bob.send("PRIVMSG alice :hello from irc")
            reply = await until_said(private, "hello from irc", sender_prefix="@irc_")
            assert reply["sender"] == f"@irc_testnet_bob:{SERVER_NAME}"  # the puppet: prefix, network, nick
            bob.transport.loseConnection()
    finally:
        await hs.stop()
