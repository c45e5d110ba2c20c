"""docker/docker-compose.yml, checked without a Docker engine: services, builds, commands
(modules exist and accept their flags), ports, the shared data volume, the GPU reservation,
health checks and start order; the Dockerfiles and .dockerignore they rely on; and that it is
secure by default (required secrets, an internal network, Redis with a password and noeviction,
only the gateway published, on loopback), each check shown to fail on a planted regression."""

from __future__ import annotations

import copy
import fnmatch
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.auth import INSECURE_NO_AUTH_ENV
from services.tls import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
APPS = {"store": "services.store_server", "worker": "services.worker_server", "gateway": "services.gateway"}
TOP_LEVEL = {"name", "services", "volumes", "networks", "configs", "secrets"}
SECRETS = {"KVSTASH_API_KEYS": "ka:alice", "KVSTASH_TENANT_SECRET": "salt-secret",
           "KVSTASH_SERVICE_TOKEN": "service-token-0123456789", "KVSTASH_REDIS_PASSWORD": "redis0pass"}
"""What an operator must set; compose refuses to start without each (``${VAR:?message}``)."""
_VAR = re.compile(r"\$\$|\$\{(\w+)(?::?([-?])([^}]*))?\}")


class MissingVariable(Exception):
    """A ``${VAR:?message}`` whose variable is unset: compose stops with the message."""


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: ``$$``, ``${VAR}``, ``${VAR:-default}``, ``${VAR:?message}``."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == "?":
            raise MissingVariable(f"{name}: {arg}")
        return arg if op == "-" else ""
    return _VAR.sub(sub, value)


def _strings(doc: Any) -> list[str]:
    """Every string in ``doc``."""
    if isinstance(doc, dict):
        return [s for v in doc.values() for s in _strings(v)]
    if isinstance(doc, list):
        return [s for v in doc for s in _strings(v)]
    return [doc] if isinstance(doc, str) else []


def render(doc: Any, env: dict[str, str]) -> Any:
    """``doc`` with every string interpolated under ``env``."""
    if isinstance(doc, dict):
        return {k: render(v, env) for k, v in doc.items()}
    if isinstance(doc, list):
        return [render(v, env) for v in doc]
    return interpolate(doc, env) if isinstance(doc, str) else doc


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


def test_redis_persists_and_is_not_published(compose: dict[str, Any]) -> None:
    redis = render(compose, SECRETS)["services"]["redis"]
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
    assert "download.pytorch.org/whl/cpu" in cpu
    assert re.search(r"pip install (-c constraints\.txt )?\.( |$)", cpu, flags=re.M)
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


def test_ports_and_addresses(compose: dict[str, Any]) -> None:
    services = render(compose, SECRETS)["services"]
    for name in APPS:
        assert flag(services[name]["command"], "--host") == "0.0.0.0", f"{name} must listen beyond its container"
    assert published(services["gateway"]) == {port_of(services["gateway"]): "127.0.0.1:8000"}
    store, worker = f"store:{port_of(services['store'])}", f"worker:{port_of(services['worker'])}"
    # The worker reads pages from the shared /data volume and coordinates through Redis, not through the store.
    assert "--store-addr" not in services["worker"]["command"]
    assert flag(services["gateway"]["command"], "--store-addr") == store
    assert flag(services["gateway"]["command"], "--worker-addr") == worker
    urls = {flag(services[name]["command"], "--metadata-url") for name in ("store", "worker")}
    assert len(urls) == 1 and re.fullmatch(rf"redis://:{SECRETS['KVSTASH_REDIS_PASSWORD']}@redis:6379/\d+", urls.pop())


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


# -- secure by default ------------------------------------------------------------------------
def check_secrets_are_required(compose: dict[str, Any]) -> None:
    """Without any one secret, compose refuses to start; with all, every service renders. Every mention of
    a secret is required (``:?``), so no service quietly starts with it empty."""
    render(compose, SECRETS)
    for text in _strings(compose):
        for m in _VAR.finditer(text):
            assert m.group(1) not in SECRETS or m.group(2) == "?", f"{m.group(0)} must be ${{{m.group(1)}:?...}}"
    for name in SECRETS:
        with pytest.raises(MissingVariable, match=name):
            render(compose, {k: v for k, v in SECRETS.items() if k != name})
    services = compose["services"]
    assert {"KVSTASH_API_KEYS", "KVSTASH_SERVICE_TOKEN"} <= set(services["gateway"]["environment"])
    assert "KVSTASH_SERVICE_TOKEN" in services["store"]["environment"]
    assert "KVSTASH_API_KEYS" in services["worker"]["environment"]
    for name in ("store", "worker"):  # the salt secret keys tenants' prefix ids where they are made
        assert "KVSTASH_TENANT_SECRET" in services[name]["environment"]


def check_nothing_runs_insecure(compose: dict[str, Any]) -> None:
    """No service is told to run without auth."""
    for name, svc in compose["services"].items():
        assert not [f for f in svc.get("command", []) if str(f).startswith("--insecure")], name
        assert INSECURE_NO_AUTH_ENV not in (svc.get("environment") or {}), name


def check_internal_network(compose: dict[str, Any]) -> None:
    """redis, store and worker only on an internal network, unpublished; the gateway alone faces out."""
    nets = compose["networks"]
    assert nets["internal"]["internal"] is True and not nets["front"].get("internal")
    for name in ("redis", "store", "worker"):
        svc = compose["services"][name]
        assert svc.get("networks") == ["internal"], f"{name} must be on the internal network only"
        assert not svc.get("ports"), f"{name} must not be published"
    gateway = compose["services"]["gateway"]
    assert set(gateway["networks"]) == {"front", "internal"}


def check_gateway_on_loopback(compose: dict[str, Any]) -> None:
    """The gateway is published on 127.0.0.1 unless the operator names another address."""
    gateway = compose["services"]["gateway"]
    assert published(render(gateway, SECRETS)) == {port_of(gateway): "127.0.0.1:8000"}
    wide = published(render(gateway, {**SECRETS, "KVSTASH_GATEWAY_HOST": "0.0.0.0", "KVSTASH_GATEWAY_PORT": "80"}))
    assert wide == {port_of(gateway): "0.0.0.0:80"}


def check_redis_password_and_noeviction(compose: dict[str, Any]) -> None:
    """Redis wants a password, never evicts, and every metadata URL carries the password."""
    services = render(compose, SECRETS)["services"]
    password = SECRETS["KVSTASH_REDIS_PASSWORD"]
    redis = services["redis"]
    assert flag(redis["command"], "--requirepass") == password
    assert flag(redis["command"], "--maxmemory-policy") == "noeviction"
    assert redis["environment"]["REDISCLI_AUTH"] == password  # the healthcheck's redis-cli authenticates
    for name in ("store", "worker"):
        url = flag(services[name]["command"], "--metadata-url")
        assert url.startswith(f"redis://:{password}@redis:"), name


SECURITY_CHECKS = [check_secrets_are_required, check_nothing_runs_insecure, check_internal_network,
                   check_gateway_on_loopback, check_redis_password_and_noeviction]


@pytest.mark.parametrize("check", SECURITY_CHECKS, ids=lambda c: c.__name__)
def test_compose_is_secure_by_default(compose: dict[str, Any], check: Any) -> None:
    check(compose)


def _set(path: str, value: Any) -> Any:
    def plant(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = doc
        for key in parents:
            node = node[key]
        node[last] = value
    return plant


def _edit_command(service: str, fn: Any) -> Any:
    def plant(doc: dict[str, Any]) -> None:
        svc = doc["services"][service]
        svc["command"] = fn(list(svc["command"]))
    return plant


REGRESSIONS = {
    "api keys optional": (_set("services.gateway.environment.KVSTASH_API_KEYS", "${KVSTASH_API_KEYS:-}"),
                          check_secrets_are_required),
    "service token optional": (_set("services.store.environment.KVSTASH_SERVICE_TOKEN", "${KVSTASH_SERVICE_TOKEN}"),
                               check_secrets_are_required),
    "redis password optional": (_edit_command("redis", lambda c: [x.replace(":?", ":-") for x in c]),
                                check_secrets_are_required),
    "gateway insecure": (_edit_command("gateway", lambda c: [*c, "--insecure-no-auth"]), check_nothing_runs_insecure),
    "store insecure": (_edit_command("store", lambda c: [*c, "--insecure"]), check_nothing_runs_insecure),
    "insecure env": (_set(f"services.worker.environment.{INSECURE_NO_AUTH_ENV}", "1"), check_nothing_runs_insecure),
    "network not internal": (_set("networks.internal.internal", False), check_internal_network),
    "store published": (_set("services.store.ports", ["127.0.0.1:50051:50051"]), check_internal_network),
    "worker on front": (_set("services.worker.networks", ["internal", "front"]), check_internal_network),
    "redis on the default network": (_set("services.redis.networks", None), check_internal_network),
    "gateway on every interface": (_set("services.gateway.ports", ["8000:8000"]), check_gateway_on_loopback),
    "redis evicts": (_edit_command("redis", lambda c: [("allkeys-lru" if x == "noeviction" else x) for x in c]),
                     check_redis_password_and_noeviction),
    "redis without password": (_edit_command("redis", lambda c: c[:c.index("--requirepass")]
                                              + c[c.index("--requirepass") + 2:]), check_redis_password_and_noeviction),
    "metadata url without password": (_edit_command("worker", lambda c: [
        (re.sub(r"//:[^@]*@", "//", x) if x.startswith("redis://") else x) for x in c]),
        check_redis_password_and_noeviction),
}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_security_checks_catch_a_planted_regression(compose: dict[str, Any], name: str) -> None:
    plant, check = REGRESSIONS[name]
    bad = copy.deepcopy(compose)
    plant(bad)
    with pytest.raises(AssertionError):
        check(bad)


# -- optional mutual TLS (docker/docker-compose.mtls.yml, layered over the main file) ---------------
MTLS = DOCKER / "docker-compose.mtls.yml"
GRPC_PARTIES = ("store", "worker", "gateway")
"""Every process that serves gRPC or calls it (the healthchecks run in the store's and worker's containers)."""


def check_mtls_override(override: dict[str, Any], compose: dict[str, Any]) -> None:
    """Each gRPC party gets all three TLS files (never a partial set), from one read-only mount; one CA for all."""
    assert {k for k in override if not k.startswith("x-")} <= TOP_LEVEL and override["name"] == compose["name"]
    assert set(override["services"]) == set(GRPC_PARTIES) <= set(compose["services"])
    with pytest.raises(MissingVariable, match="KVSTASH_TLS_DIR"):
        render(override, SECRETS)
    rendered = render(override, {**SECRETS, "KVSTASH_TLS_DIR": "/etc/kvstash-tls"})["services"]
    cas, certs = set(), set()
    for name in GRPC_PARTIES:
        env = rendered[name]["environment"]
        assert set(env) == {TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV}, name
        (mount,) = rendered[name]["volumes"]
        src, dst, mode = mount.split(":")
        assert src == "/etc/kvstash-tls" and mode == "ro", name
        assert all(Path(v).parent == Path(dst) for v in env.values()), name
        cas.add(env[TLS_CA_ENV])
        certs.add(env[TLS_CERT_ENV])
    assert len(cas) == 1 and len(certs) == len(GRPC_PARTIES)


def test_mtls_override_is_complete(compose: dict[str, Any]) -> None:
    override = yaml.safe_load(MTLS.read_text())
    check_mtls_override(override, compose)
    assert MTLS.name in COMPOSE.read_text(), "the main file says how to turn mTLS on"
    partial = copy.deepcopy(override)
    del partial["services"]["worker"]["environment"][TLS_KEY_ENV]
    with pytest.raises(AssertionError, match="worker"):
        check_mtls_override(partial, compose)
