"""Start and stop local `kvgate sim` / `kvgate serve` processes (used by the demo and the tests)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PORTS = range(20000, 32768)
"""Where `free_port` looks: below Linux's ephemeral range (32768-60999), which every outgoing
connection draws from, so a port handed out here is not taken by some client's connection
before the child binds it (seen in CI: a sim's port, picked by `bind(0)`, taken meanwhile)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    for _ in range(100):
        port = random.choice(PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        found: int = s.getsockname()[1]
        return found


class StartupError(RuntimeError):
    """A child process exited or never became healthy."""


@dataclass
class Child:
    """A running kvgate subprocess and where it listens."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL at once, as a crash would."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, lines: int = 30) -> str:
        """Last lines of the child's output, for error messages."""
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def spawn(name: str, args: Sequence[str], url: str, log_dir: Path) -> Child:
    """Run `python -m kvgate.cli ARGS` with output captured to `log_dir/NAME.log`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvgate.cli", *args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        )
    return Child(name, url, proc, log_path)


def wait_healthy(child: Child, timeout: float = 60.0, path: str = "/health") -> None:
    """Poll `GET url/health` until 200; raise StartupError with the child's log otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise StartupError(
                f"{child.name} exited with code {child.proc.returncode}:\n{child.log_tail()}"
            )
        with (
            contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
            urllib.request.urlopen(child.url + path, timeout=2) as r,
        ):
            if r.status == 200:
                return
        time.sleep(0.1)
    raise StartupError(f"{child.name} not healthy after {timeout:.0f}s:\n{child.log_tail()}")


def start_sim(
    name: str, log_dir: Path, extra: Sequence[str] = (), host: str = "127.0.0.1"
) -> Child:
    """Start one simulated engine on a free port and wait until it is healthy."""
    port = free_port(host)
    child = spawn(name, ["sim", "--host", host, "--port", str(port), *extra],
                  f"http://{host}:{port}", log_dir)
    wait_healthy(child)
    return child


def start_gateway(
    engine_urls: Sequence[str], log_dir: Path, extra: Sequence[str] = (),
    host: str = "127.0.0.1", name: str = "gateway",
) -> Child:
    """Start `kvgate serve` in front of `engine_urls` on a free port and wait until healthy."""
    port = free_port(host)
    child = spawn(name, ["serve", "--engines", ",".join(engine_urls), "--host", host,
                         "--port", str(port), *extra], f"http://{host}:{port}", log_dir)
    wait_healthy(child)
    return child
