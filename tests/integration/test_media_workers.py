"""The media repository in the worker layout: a ``media_repository`` worker serves every media
endpoint, the main process none, and docker/nginx.conf (run by a real nginx) routes media to
the worker and the rest to the main process; an access token revoked on the main process
stops working on the media worker (the caches stream, over Redis)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from twisted.internet import task

from tests.conftest import scratch_database
from tests.harness import Nginx, TributaryProcess, configure_workers, free_port
from tests.integration.media_support import http, image_size, png, register, upload
from tests.twisted_plugin import reactor

pytestmark = pytest.mark.e2e


def add_media_worker(main: TributaryProcess) -> tuple[TributaryProcess, int, int]:
    """Add worker ``m1`` (app media_repository, a client+federation listener and metrics)."""
    config = yaml.safe_load(main.config_path.read_text(encoding="utf-8"))
    client, metrics = free_port(), free_port()
    config["workers"]["m1"] = {"app": "media_repository", "listeners": [
        {"type": "http", "port": client, "resources": ["client", "federation", "health"]},
        {"type": "metrics", "port": metrics}]}
    main.config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return main.worker("m1", client), client, metrics


@pytest.mark.timeout(120)
async def test_media_worker_serves_media_behind_nginx(postgres_template: str, redis_url: str, tmp_path: Path) -> None:
    with scratch_database(postgres_template) as dsn:
        main, _workers, _generic = configure_workers(tmp_path / "a", dsn, redis_url, persisters=0, senders=0)
        media, media_port, metrics_port = add_media_worker(main)
        # No generic worker in this test: its upstream points at the main process.
        nginx = Nginx.for_workers(tmp_path / "nginx", main_port=main.client_port, generic_port=main.client_port,
                                  media_port=media_port)
        started: list[TributaryProcess] = []
        try:
            for process in (main, media):
                process.start()
                started.append(process)
            nginx.start()
            front = f"http://127.0.0.1:{nginx.port}"
            token = await register(front, "alice")  # the main process, through nginx
            data = png(300, 200)
            uri = await upload(front, token, data, "image/png", "pic.png")
            media_id = uri.rsplit("/", 1)[1]
            got = await http("GET", f"{front}/_matrix/client/v1/media/download/{main.server_name}/{media_id}",
                             token=token)
            assert got.code == 200 and got.body == data
            thumb = await http("GET", f"{front}/_matrix/client/v1/media/thumbnail/{main.server_name}/{media_id}"
                                      "?width=32&height=32&method=crop", token=token)
            assert thumb.code == 200 and image_size(thumb.body) == (32, 32)
            # The media worker did it: its metrics count the upload; its disk holds the file.
            status, body = media.get("/metrics", port=metrics_port)
            assert status == 200 and 'tributary_media_uploads_total{outcome="stored"} 1.0' in body.decode()
            assert any(p.is_file() for p in (main.data_dir / "media").rglob("*"))
            # The main process serves no media once a media worker is configured.
            direct = await http("POST", f"{main.base_url}/_matrix/media/v3/upload", b"x", token=token,
                                headers={"Content-Type": "text/plain"})
            assert direct.code == 404 and direct.errcode == "M_UNRECOGNIZED"
            # ... and the media worker serves nothing else.
            other = await http("GET", f"http://127.0.0.1:{media_port}/_matrix/client/v3/account/whoami", token=token)
            assert other.code == 404
            # A token revoked on the main process stops working on the media worker.
            assert (await http("POST", f"{front}/_matrix/client/v3/logout", b"{}", token=token)).code == 200
            for _ in range(200):
                answer = await http("GET", f"{front}/_matrix/client/v1/media/config", token=token)
                if answer.code == 401:
                    break
                await task.deferLater(reactor, 0.1, lambda: None)
            assert answer.code == 401 and answer.errcode == "M_UNKNOWN_TOKEN", answer
        finally:
            nginx.stop()
            for process in reversed(started):
                assert process.stop() == 0, process.output[-5000:]
                assert "Traceback" not in process.output, process.output[-5000:]
