"""Pytest plugin module: a real ``redis-server`` on a free loopback port, in a temp dir.

Import the fixture into a test module (``from redis_server import redis_server``). The
server persists with AOF and ``appendfsync always``, so a test can kill and restart it
and expect every acknowledged write back. Without ``redis-server`` on PATH the fixture
fails (it never skips): CI installs it.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

INSTALL_HINT = ("redis-server is not on PATH; the Redis metadata tests need a real server. "
                "Install it: `apt-get install -y redis-server` (Debian/Ubuntu) or `brew install redis`.")
START_TIMEOUT_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server process bound to 127.0.0.1 with its data (AOF) in ``workdir``."""

    def __init__(self, executable: str, workdir: Path, port: int | None = None) -> None:
        self.executable, self.workdir = executable, workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        """The server's log file."""
        return self.workdir / "redis.log"

    def start(self) -> None:
        """Start the server and wait until it answers PING (its AOF, if any, is loaded by then)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--protected-mode", "yes",
                "--dir", str(self.workdir), "--appendonly", "yes", "--appendfsync", "always", "--save", "",
                "--daemonize", "no", "--logfile", str(self.log_path)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self._diagnostics()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    self.stop(hard=True)
                    raise RuntimeError(f"redis-server did not answer within {START_TIMEOUT_S} s: "
                                       f"{self._diagnostics()}")
                time.sleep(0.02)
        finally:
            client.close()

    def _diagnostics(self) -> str:
        err = self.proc.stderr.read().decode(errors="replace") if self.proc and self.proc.stderr else ""
        log = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        return f"{err}\n{log}".strip()

    def stop(self, hard: bool = False) -> None:
        """SIGTERM (a clean shutdown) or SIGKILL (a crash); waits for the process to exit."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if hard else signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def restart(self, hard: bool = False) -> None:
        """Stop (cleanly or by SIGKILL) and start again on the same port and data dir."""
        self.stop(hard=hard)
        self.start()


@contextlib.contextmanager
def running_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A started redis-server in a fresh directory, stopped on exit; fails (never skips) when redis-server is
    not installed."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    server = RedisServer(exe, tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture()
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A fresh redis-server for one test."""
    with running_redis(tmp_path_factory) as server:
        yield server
