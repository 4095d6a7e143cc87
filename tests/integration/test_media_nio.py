"""matrix-nio, unmodified, against a real ``tributary run``: Alice uploads an image and makes it
her avatar; Bob reads her profile, downloads the avatar and a thumbnail of it; the bytes match."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import nio
import pytest
from nio import responses

from tests.harness import TributaryProcess
from tests.integration.media_support import image_size, png
from tests.integration.test_client_nio import run

pytestmark = pytest.mark.e2e


@pytest.fixture
def server(tmp_path: Path, database_dsn: str) -> Iterator[TributaryProcess]:
    hs = TributaryProcess.configure(tmp_path, database_url=database_dsn, extra={"log_level": "WARNING"})
    hs.start()
    try:
        yield hs
    finally:
        assert hs.stop() == 0, hs.output
        assert "Traceback" not in hs.output, hs.output


async def test_nio_uploads_an_avatar_that_another_user_downloads_and_thumbnails(server: TributaryProcess) -> None:
    alice = nio.AsyncClient(server.base_url, "alice")
    bob = nio.AsyncClient(server.base_url, "bob")
    try:
        assert isinstance(await run(alice.register("alice", "pw")), responses.RegisterResponse)
        assert isinstance(await run(bob.register("bob", "pw")), responses.RegisterResponse)
        data = png(400, 300, (20, 40, 250))
        uploaded, keys = await run(alice.upload(io.BytesIO(data), content_type="image/png", filename="me.png",
                                                filesize=len(data)))
        assert isinstance(uploaded, responses.UploadResponse), uploaded
        assert keys is None and uploaded.content_uri.startswith("mxc://localhost/")
        assert isinstance(await run(alice.set_avatar(uploaded.content_uri)), responses.ProfileSetAvatarResponse)

        avatar = await run(bob.get_avatar("@alice:localhost"))
        assert isinstance(avatar, responses.ProfileGetAvatarResponse) and avatar.avatar_url == uploaded.content_uri
        downloaded = await run(bob.download(avatar.avatar_url))
        assert isinstance(downloaded, responses.MemoryDownloadResponse), downloaded
        assert downloaded.body == data and downloaded.content_type == "image/png"
        assert downloaded.filename == "me.png"

        media_id = avatar.avatar_url.rsplit("/", 1)[1]
        thumb = await run(bob.thumbnail("localhost", media_id, 96, 96, nio.ResizingMethod.crop))
        assert isinstance(thumb, responses.ThumbnailResponse), thumb
        assert thumb.content_type == "image/png" and image_size(thumb.body) == (96, 96)
        config = await run(bob.content_repository_config())
        assert isinstance(config, responses.ContentRepositoryConfigResponse) and config.upload_size == 50 * 1024 ** 2
    finally:
        await run(alice.close())
        await run(bob.close())
