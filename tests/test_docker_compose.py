"""docker/docker-compose.yml, checked without a Docker engine: services, builds, commands
(modules exist and accept their flags), ports, the shared data volume, the GPU reservation,
health checks and start order; the Dockerfiles and .dockerignore they rely on."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
APPS = {"store": "services.store_server", "worker": "services.worker_server", "gateway": "services.gateway"}
TOP_LEVEL = {"name", "services", "volumes", "networks", "configs", "secrets"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def flag(command: list[str], name: str) -> str:
    """The value after ``name`` in an exec-form command."""
    assert name in command, f"{name} missing from {command}"
    return command[command.index(name) + 1]


def port_of(service: dict[str, Any]) -> int:
    return int(flag(service["command"], "--port"))


def published(service: dict[str, Any]) -> dict[int, str]:
    """Container port -> host binding (``[ip:]port``) from short-syntax ``ports``."""
    out = {}
    for entry in service.get("ports", []):
        host, _, container = str(entry).rpartition(":")
        out[int(container)] = host
    return out


def module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__main__.py") if p.exists()), None)


def test_top_level_and_required_services(compose: dict[str, Any], services: dict[str, Any]) -> None:
    assert {k for k in compose if not k.startswith("x-")} <= TOP_LEVEL
    assert {"redis", *APPS} <= set(services)
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        assert isinstance(svc.get("command", []), list), f"{name}: use the exec form (a list)"


def test_redis_persists_and_is_not_published(services: dict[str, Any], compose: dict[str, Any]) -> None:
    redis = services["redis"]
    assert str(redis["image"]).startswith("redis:7")
    cmd = redis["command"]
    assert flag(cmd, "--appendonly") == "yes" and flag(cmd, "--appendfsync") in {"always", "everysec"}
    (volume,) = redis["volumes"]
    src, _, dst = volume.partition(":")
    assert dst == "/data" and src in compose["volumes"]
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert "ports" not in redis, "Redis stays on the compose network"


def _dockerfile(svc: dict[str, Any]) -> Path:
    build = svc["build"]
    context = (DOCKER / build["context"]).resolve()
    assert context == REPO, "the build context is the repository root"
    path = context / build.get("dockerfile", "Dockerfile")
    assert path.is_file(), path
    return path


def _dockerignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified: the last matching pattern wins; ``!`` re-includes."""
    ignored = False
    for pat in patterns:
        neg, pat = pat.startswith("!"), pat.lstrip("!").rstrip("/")
        hit = fnmatch.fnmatch(rel, pat) or rel.startswith(pat + "/") or (
            pat.startswith("**/") and any(fnmatch.fnmatch(part, pat[3:]) for part in rel.split("/")))
        if hit:
            ignored = not neg
    return ignored


def test_builds_use_existing_dockerfiles_and_sources(services: dict[str, Any]) -> None:
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for rel in (".venv", ".git", "data", ".mypy_cache"):
        assert _dockerignored(rel, patterns), f"{rel} must stay out of the build context"
    for name in APPS:
        text = _dockerfile(services[name]).read_text()
        for src in re.findall(r"^COPY\s+(?:--\S+\s+)*(.+?)\s+\S+$", text, flags=re.M):
            for part in src.split():
                assert (REPO / part).exists(), f"{name}: COPY {part} does not exist"
                assert not _dockerignored(part, patterns), f"{name}: COPY {part} is excluded by .dockerignore"
        assert "pip install" in text and "USER " in text
    cpu, cuda = _dockerfile(services["store"]).read_text(), _dockerfile(services["worker"]).read_text()
    assert re.search(r"^FROM python:3\.\d+-slim", cpu, flags=re.M)
    assert "download.pytorch.org/whl/cpu" in cpu and re.search(r"pip install \.( |$)", cpu, flags=re.M)
    assert re.search(r"ARG BASE_IMAGE=pytorch/pytorch:\S*cuda", cuda) and 'pip install ".[gpu]"' in cuda
    assert services["store"]["build"] == services["gateway"]["build"]
    assert services["store"]["image"] == services["gateway"]["image"] != services["worker"]["image"]


def test_commands_run_modules_of_this_repo(services: dict[str, Any]) -> None:
    for name, module in APPS.items():
        cmd = services[name]["command"]
        assert cmd[:3] == ["python", "-m", module], cmd
        assert module_file(module) is not None, f"{name}: {module} does not exist in the repository"
    assert module_file("services.healthcheck") is not None


@pytest.mark.slow
def test_commands_accept_their_flags(services: dict[str, Any]) -> None:
    """``python -m MODULE --help`` lists every flag the compose file passes."""
    procs = {name: subprocess.Popen([sys.executable, "-m", module, "--help"], cwd=REPO, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for name, module in APPS.items() if module_file(module)}
    assert len(procs) == len(APPS), "a service module is missing"
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{APPS[name]} --help failed:\n{out[-2000:]}"
        missing = [f for f in services[name]["command"] if f.startswith("--") and f not in out]
        assert not missing, f"{APPS[name]} does not accept {missing}"


def test_ports_and_addresses(services: dict[str, Any]) -> None:
    hosts = []
    for name in APPS:
        svc = services[name]
        assert flag(svc["command"], "--host") == "0.0.0.0", f"{name} must listen beyond its container's loopback"
        ports = published(svc)
        assert port_of(svc) in ports, f"{name}: --port is not published"
        hosts.append(ports[port_of(svc)].rpartition(":")[2])
    assert len(hosts) == len(set(hosts)), "host ports collide"
    store, worker = f"store:{port_of(services['store'])}", f"worker:{port_of(services['worker'])}"
    # The worker reads pages from the shared /data volume and coordinates through Redis, not through the store.
    assert "--store-addr" not in services["worker"]["command"]
    assert flag(services["gateway"]["command"], "--store-addr") == store
    assert flag(services["gateway"]["command"], "--worker-addr") == worker
    urls = {flag(services[name]["command"], "--metadata-url") for name in ("store", "worker")}
    assert len(urls) == 1 and re.fullmatch(r"redis://redis:6379/\d+", urls.pop())


def test_store_and_worker_share_the_data_volume(services: dict[str, Any], compose: dict[str, Any]) -> None:
    mounts = []
    for name in ("store", "worker"):
        svc = services[name]
        home = flag(svc["command"], "--home")
        (mount,) = [v for v in svc["volumes"] if v.split(":")[1] == home]
        mounts.append(mount.split(":")[0])
    assert mounts[0] == mounts[1] and mounts[0] in compose["volumes"]


def test_worker_reserves_a_gpu(services: dict[str, Any]) -> None:
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"]
               and (d.get("count") == "all" or int(d.get("count", 0)) >= 1 or d.get("device_ids")) for d in devices)


def test_healthchecks_and_start_order(services: dict[str, Any]) -> None:
    for name in ("store", "worker"):
        test = services[name]["healthcheck"]["test"]
        assert test == ["CMD", "python", "-m", "services.healthcheck", f"localhost:{port_of(services[name])}"]
    gateway = services["gateway"]
    assert f"http://localhost:{port_of(gateway)}/healthz" in " ".join(gateway["healthcheck"]["test"])
    assert '"/healthz"' in (REPO / "services" / "gateway.py").read_text()
    needs = {"store": {"redis"}, "worker": {"redis", "store"}, "gateway": {"store", "worker"}}
    for name, deps in needs.items():
        depends = services[name]["depends_on"]
        assert set(depends) >= deps, name
        for dep in depends:
            assert depends[dep]["condition"] == "service_healthy" and "healthcheck" in services[dep]
