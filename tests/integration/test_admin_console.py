"""The operator console (homeserver/admin/console.py) in a real browser: Debian's Chromium,
headless, driven by Selenium through Debian's chromedriver (no browser download). The page is
served on a listener with only the ``admin`` resource; an admin pastes a token and sees users,
rooms, destinations and the processes with their stream positions. A screenshot is kept."""

# tests: homeserver/admin/console.py

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import REPO_ROOT, TributaryProcess, free_port

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


def _call(method: str, url: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), method=method,
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_console_shows_users_rooms_and_processes_in_headless_chromium(tmp_path: Path, database_dsn: str) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    assert CHROMIUM.exists() and CHROMEDRIVER.exists(), "make test installs them (.ci/install-browser.sh)"
    hs = TributaryProcess.configure(tmp_path, database_url=database_dsn)
    admin_port = free_port()
    config = yaml.safe_load(hs.config_path.read_text())
    config["listeners"].append({"type": "http", "port": admin_port, "resources": ["admin"]})
    hs.config_path.write_text(yaml.safe_dump(config))
    created = subprocess.run([sys.executable, "-m", "homeserver.cli", "register-user", "--config",
                              str(hs.config_path), "--user", "operator", "--admin"], input="console-pw\n",
                             capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert created.returncode == 0, created.stderr
    hs.start()
    driver = None
    try:
        client = hs.base_url + "/_matrix/client/v3"
        token = _call("POST", client + "/login", {"type": "m.login.password", "password": "console-pw",
                                                  "identifier": {"type": "m.id.user", "user": "operator"}})[1][
            "access_token"]
        user = _call("POST", client + "/register", {"username": "visitor", "password": "visitor-pw",
                                                    "auth": {"type": "m.login.dummy"}})[1]
        room = _call("POST", client + "/createRoom", {"name": "Console room"}, token=user["access_token"])[1]
        admin_base = f"http://127.0.0.1:{admin_port}"
        # The admin listener serves the console and the admin API, not the client API.
        assert _call("GET", admin_base + "/_matrix/client/versions")[0] == 404
        assert _call("GET", admin_base + "/_tributary/console/status", token=user["access_token"])[0] == 403
        status, body = _call("GET", admin_base + "/_tributary/console/status", token=token)
        assert status == 200 and body["processes"][0]["name"] == "master"
        assert body["processes"][0]["positions"]["events"] == body["streams"]["events"] > 0
        # ... and the client listener does not serve the console.
        assert _call("GET", hs.base_url + "/_tributary/console/status", token=token)[0] == 404

        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                         "--window-size=1400,1800", f"--user-data-dir={tmp_path / 'chromium'}"):
            options.add_argument(argument)
        os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never download anything
        driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
        driver.get(admin_base + "/_tributary/console/")
        assert driver.title == "Tributary console"
        driver.find_element(By.ID, "token").send_keys(token)
        driver.find_element(By.CSS_SELECTOR, "#login button").click()
        WebDriverWait(driver, 20).until(
            lambda d: d.execute_script("return document.body.dataset.loaded === 'true' "
                                       "|| document.getElementById('error').textContent !== ''"))
        assert driver.find_element(By.ID, "error").text == ""
        users = driver.find_element(By.ID, "users").text
        assert "@operator:localhost" in users and "@visitor:localhost" in users
        rooms = driver.find_element(By.ID, "rooms").text
        assert room["room_id"] in rooms and "Console room" in rooms
        processes = driver.find_element(By.ID, "processes").text
        assert "master" in processes and "events=" in processes
        assert driver.find_element(By.ID, "destinations").text
        screenshot = tmp_path / "console.png"
        assert driver.save_screenshot(str(screenshot))
        assert screenshot.stat().st_size > 10_000
        print(f"console screenshot: {screenshot}")
    finally:
        if driver is not None:
            driver.quit()
        assert hs.stop() == 0, hs.output[-3000:]


@pytest.mark.parametrize(("resources", "admin_api", "console"), [
    (("federation", "keys"), False, False),
    (("client", "health"), True, False),
    (("admin",), True, True),
])
def test_admin_paths_by_listener_resource(tmp_path: Path, resources: tuple[str, ...], admin_api: bool,
                                          console: bool) -> None:
    """The admin API is routed on listeners with the client or admin resource, the console only
    with admin, and neither on a federation listener."""
    from prometheus_client import CollectorRegistry

    from homeserver.app import HomeServer
    from homeserver.config import ListenerConfig, parse_config
    from tests.twisted_plugin import reactor

    hs = HomeServer(parse_config({"server_name": "localhost", "data_dir": str(tmp_path)}), reactor,
                    registry=CollectorRegistry())
    root = hs._root_resource(ListenerConfig(type="http", port=free_port(), resources=resources))
    assert (root._admin is not None) == admin_api  # type: ignore[attr-defined]
    assert (root._console is not None) == console  # type: ignore[attr-defined]
