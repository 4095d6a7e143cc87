"""The admin API and the console in the worker layout: the main process serves them (a generic
worker does not), the console lists every process with its stream positions and the
replication transport, and a backoff reset on the main process reaches the federation
sender worker that owns the destination, which then sends at once."""

# tests: homeserver/admin/servlets.py, homeserver/admin/console.py, homeserver/app.py

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import yaml
from twisted.internet import task

from tests.federation_peer import Behaviour, FederationPeer
from tests.harness import REPO_ROOT, configure_workers, free_port
from tests.integration.test_client_support import Client
from tests.twisted_plugin import reactor


async def pause() -> None:
    await task.deferLater(reactor, 0.05, lambda: None)


async def test_worker_layout_admin_console_and_backoff_reset_across_processes(
        tmp_path: Path, database_dsn: str, redis_url: str) -> None:
    main, workers, generic_port = configure_workers(tmp_path, database_dsn, redis_url, persisters=1, senders=1,
                                                    extra={"rc_admin": {"per_second": 1000, "burst_count": 1000}})
    admin_port = free_port()
    config = yaml.safe_load(main.config_path.read_text())
    config["listeners"].append({"type": "http", "port": admin_port, "resources": ["admin"]})
    main.config_path.write_text(yaml.safe_dump(config))
    created = subprocess.run([sys.executable, "-m", "homeserver.cli", "register-user", "--config",
                              str(main.config_path), "--user", "root", "--admin"], input="root-pw\n",
                             capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert created.returncode == 0, created.stderr
    processes = [main, *workers.values()]
    peer = FederationPeer(reactor, request_timeout_seconds=10)
    try:
        for process in processes:
            process.start()
        client = Client(main.base_url)
        admin = Client(f"http://127.0.0.1:{admin_port}")
        token = (await client.login("root", "root-pw")).body["access_token"]
        on_worker = await Client(f"http://127.0.0.1:{generic_port}").request(
            "GET", "/_synapse/admin/v2/users", token=token)
        assert on_worker.status == 404 and on_worker.errcode == "M_UNRECOGNIZED"

        alice = await client.register_ok("alice")
        room = await client.request("POST", "createRoom", {"preset": "public_chat"}, token=alice["access_token"])
        room_id = room.body["room_id"]
        (remote,) = await peer.start(1)
        await peer.join(remote, f"@visitor:{remote}", room_id, via=main.server_name)
        await peer.set_behaviour(remote, Behaviour.ERROR_500)
        sent = await client.request("PUT", f"rooms/{quote(room_id)}/send/m.room.message/t1",
                                    {"msgtype": "m.text", "body": "anyone?"}, token=alice["access_token"])
        assert sent.status == 200, sent
        path = f"/_synapse/admin/v1/federation/destinations/{quote(remote)}"
        for _ in range(400):
            details = await admin.request("GET", path, token=token)
            if details.status == 200 and details.body["retry_interval"] > 0:
                break
            await pause()
        assert details.body["retry_interval"] > 0, details

        status = await admin.request("GET", "/_tributary/console/status", token=token)
        assert status.status == 200, status
        by_name = {p["name"]: p for p in status.body["processes"]}
        assert set(by_name) == {"master", "p1", "g1", "fs1"}
        assert "events" in by_name["p1"]["writes"] and by_name["p1"]["positions"]["events"] > 0
        assert "events" not in by_name["master"]["writes"]
        assert by_name["fs1"]["app"] == "federation_sender" and by_name["fs1"]["writes"] == []
        assert status.body["replication"]["transport"].startswith("redis")

        await peer.set_behaviour(remote, Behaviour.OK)
        reset = await admin.request("POST", path + "/reset_connection", {}, token=token)
        assert reset.status == 200, reset
        # fs1 owns the destination: REMOTE_SERVER_UP reaches it over Redis, and it sends now.
        await peer.wait_for_pdus(remote, [sent.body["event_id"]], timeout=10)
    finally:
        await peer.stop()
        for process in reversed(processes):
            if process.process is not None:
                process.stop()
