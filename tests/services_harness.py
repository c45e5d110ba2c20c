"""Starts the service topology (store, worker, gateway; optionally redis) as real processes on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 90.0
SERVICE_TOKEN = "harness-service-token"
"""``KVSTASH_SERVICE_TOKEN`` of a topology unless ``env_extra`` sets one (store and gateway share it)."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Topology:
    """Addresses of a running topology."""

    store_addr: str
    worker_addr: str
    gateway_url: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def log(self, name: str) -> str:
        """What a process printed so far."""
        return self.logs[name].read_text(errors="replace")

    def restart(self, name: str) -> None:
        """Start process ``name`` again with its command (after it exited); returns once it is healthy."""
        assert self.procs[name].poll() is not None, f"{name} is still running"
        log_dir = self.logs[name].parent
        self.procs[name], self.logs[name] = start(f"{name}-restarted", self.commands[name], self.env, log_dir)
        addr = {"store": self.store_addr, "worker": self.worker_addr}.get(name)
        if addr:
            wait_grpc(addr, self.procs[name], self.logs[name])
        else:
            wait_http(self.gateway_url, self.procs[name], self.logs[name])


def start(name: str, args: list[str], env: dict[str, str], log_dir: Path) -> tuple[subprocess.Popen, Path]:
    """Start ``python -m <args>`` with output to a log file."""
    log = log_dir / f"{name}.log"
    f = open(log, "w")  # noqa: SIM115 - closed when the process ends
    p = subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    return p, log


def wait_grpc(addr: str, proc: subprocess.Popen, log: Path) -> None:
    """Until the gRPC health check passes (fails if the process died)."""
    from services.healthcheck import check

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited: {log.read_text()[-3000:]}")
        if check(addr):
            return
        time.sleep(0.3)
    raise TimeoutError(f"{addr} not healthy: {log.read_text()[-3000:]}")


def wait_http(url: str, proc: subprocess.Popen, log: Path) -> None:
    """Until GET /healthz answers 200."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy: {log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    """Terminate, then kill."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextmanager
def topology(home: Path, model: Path, env_extra: dict[str, str], metadata_url: str | None = None,
             worker_args: tuple[str, ...] = (), gateway_args: tuple[str, ...] = ()) -> Iterator[Topology]:
    """store + worker + gateway, the same commands docker-compose runs, on loopback."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVSTASH_SERVICE_TOKEN": SERVICE_TOKEN, **env_extra}
    meta = ["--metadata-url", metadata_url] if metadata_url else []
    sp, wp, gp = free_port(), free_port(), free_port()
    topo = Topology(store_addr=f"127.0.0.1:{sp}", worker_addr=f"127.0.0.1:{wp}", gateway_url=f"http://127.0.0.1:{gp}",
                    env=env)
    log_dir = home.parent
    try:
        for name, args in [
            ("store", ["services.store_server", "--port", str(sp), "--home", str(home), *meta]),
            ("worker", ["services.worker_server", "--port", str(wp), "--max-per-tenant", "16", "--max-active", "32",
                        "--home", str(home), "--model", str(model),
                        "--device", "cpu", *meta, *worker_args]),
            ("gateway", ["services.gateway", "--port", str(gp), "--worker-addr", topo.worker_addr, "--store-addr",
                         topo.store_addr, *gateway_args]),
        ]:
            topo.procs[name], topo.logs[name] = start(name, args, env, log_dir)
            topo.commands[name] = args
        wait_grpc(topo.store_addr, topo.procs["store"], topo.logs["store"])
        wait_grpc(topo.worker_addr, topo.procs["worker"], topo.logs["worker"])
        wait_http(topo.gateway_url, topo.procs["gateway"], topo.logs["gateway"])
        yield topo
    finally:
        for p in topo.procs.values():
            stop(p)
