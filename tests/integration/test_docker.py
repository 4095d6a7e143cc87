# tests: docker/compose.yml docker/prometheus.yml docker/nginx.conf docker/config/homeserver.yaml docker/Dockerfile
"""The container set-up, checked with the real tools short of a container engine.

This machine has the docker client but no engine: ``docker compose config``
(or Debian's ``docker-compose config``, installed by
``.ci/install-observability.sh`` when the compose plugin is absent) validates
and renders the compose file without one. ``promtool`` (Debian's prometheus
package) checks the scrape config and ``nginx -t`` the proxy config. The
rest checks that the files agree with each other: every worker the compose
file starts is declared in the shared config, and Prometheus scrapes every
Tributary service on its metrics port.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import REPO_ROOT

DOCKER = REPO_ROOT / "docker"
TRIBUTARY_IMAGE = "tributary:latest"


def _compose_command() -> list[str]:
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    if legacy is not None:
        return [legacy]
    pytest.fail(
        "neither `docker compose` nor `docker-compose` is installed: run `bash .ci/install-observability.sh`",
        pytrace=False,
    )


def _tool(name: str) -> str:
    path = shutil.which(name) or next((p for p in (f"/usr/bin/{name}", f"/usr/sbin/{name}") if Path(p).exists()), None)
    if path is None:
        pytest.fail(f"{name} is not installed: run `bash .ci/install-observability.sh`", pytrace=False)
    return path


def _compose() -> dict[str, Any]:
    """The compose file as the compose tool renders it (anchors merged, paths resolved)."""
    result = subprocess.run(
        [*_compose_command(), "-f", str(DOCKER / "compose.yml"), "config"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    rendered: dict[str, Any] = yaml.safe_load(result.stdout)
    return rendered


def test_compose_file_is_valid_and_has_every_service() -> None:
    services = _compose()["services"]
    assert {"postgres", "redis", "main", "generic1", "persister1", "persister2", "federation_sender1", "media1",
            "nginx", "prometheus", "grafana"} <= set(services)
    assert "build" in services["main"]
    for name, service in services.items():
        if service.get("image") == TRIBUTARY_IMAGE:
            assert any(str(v).endswith(":/config:ro") or str(v.get("target", "")) == "/config"
                       for v in _volumes(service)), name


def _volumes(service: dict[str, Any]) -> list[Any]:
    return list(service.get("volumes", []))


def test_each_worker_service_is_a_worker_of_the_shared_config() -> None:
    services = _compose()["services"]
    config = yaml.safe_load((DOCKER / "config" / "homeserver.yaml").read_text(encoding="utf-8"))
    started: dict[str, str] = {}
    for service_name, service in services.items():
        command = service.get("command") or []
        if service.get("image") != TRIBUTARY_IMAGE or command[:1] != ["worker"]:
            continue
        assert command[command.index("--config") + 1] == "/config/homeserver.yaml"
        name = command[command.index("--name") + 1]
        started[name] = config["workers"][name]["app"]
        assert service_name == name  # the service's DNS name is the one instance_map and Prometheus use
    assert sorted(started.values()) == ["event_persister", "event_persister", "federation_sender", "generic",
                                        "media_repository"]
    for writers in config["stream_writers"].values():
        for writer in writers:
            assert writer in config["instance_map"], f"stream writer {writer} is not in instance_map"
    for instance, where in config["instance_map"].items():
        host = "main" if instance == "master" else instance
        assert where["host"] in services and where["host"] == host
    assert config["federation_sender_instances"] == ["federation_sender1"]
    assert config["send_federation"] is False and config["redis"]["enabled"] is True


def test_prometheus_scrapes_every_tributary_process() -> None:
    result = subprocess.run([_tool("promtool"), "check", "config", str(DOCKER / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    services = _compose()["services"]
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text(encoding="utf-8"))
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "tributary")
    scraped = {t.split(":")[0]: static["labels"] for static in job["static_configs"] for t in static["targets"]}
    tributary_services = {n for n, s in services.items() if s.get("image") == TRIBUTARY_IMAGE}
    assert set(scraped) == tributary_services
    homeserver = yaml.safe_load((DOCKER / "config" / "homeserver.yaml").read_text(encoding="utf-8"))
    for service, labels in scraped.items():
        listeners = homeserver["listeners"] if service == "main" else homeserver["workers"][service]["listeners"]
        assert any(listener["type"] == "metrics" and listener["port"] == 9100 for listener in listeners), service
        assert labels["instance_name"] == ("master" if service == "main" else service)


def test_nginx_config_is_accepted_by_nginx(tmp_path: Path) -> None:
    """``nginx -t`` resolves upstream host names, which exist only inside
    compose: the same file with the upstreams on loopback."""
    text = (DOCKER / "nginx.conf").read_text(encoding="utf-8")
    services = _compose()["services"]
    for service in ("main", "generic1", "media1"):
        assert f"server {service}:8008;" in text and service in services
        text = text.replace(f"server {service}:8008;", "server 127.0.0.1:9;")
    config = tmp_path / "nginx.conf"
    config.write_text(text, encoding="utf-8")
    result = subprocess.run([_tool("nginx"), "-t", "-c", str(config), "-p", str(tmp_path), "-g", "error_log stderr;"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_dockerfile_installs_the_package_and_runs_as_an_unprivileged_user() -> None:
    lines = [line.strip() for line in (DOCKER / "Dockerfile").read_text(encoding="utf-8").splitlines()]
    froms = [line for line in lines if line.startswith("FROM ")]
    assert froms and all("-slim" in line for line in froms)
    assert any(line.startswith("USER ") and line.split()[1] not in ("root", "0") for line in lines)
    assert 'ENTRYPOINT ["tributary"]' in lines
    assert any("pip install ." in line for line in lines)
    # Every package the distribution includes is copied into the build.
    pyproject = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    include = pyproject.split("include = [", 1)[1].split("]", 1)[0]
    for package in (p.strip().strip('"').rstrip("*") for p in include.split(",") if p.strip()):
        assert f"COPY {package} ./{package}" in lines, package
