"""A private, throw-away redis-server on a free 127.0.0.1 port, for tests.

    with RedisServer() as url:      # "redis://127.0.0.1:PORT/0"
        ...

Never touches a system Redis: it starts its own process (no persistence, no config file), waits
until it answers PING (bounded), and stops it on exit (SIGTERM, then SIGKILL). On Linux the
server also gets SIGTERM if the test process dies without cleaning up. `redis_server_available`
lets tests skip, rather than fail, when redis-server is not installed.
"""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from kvgate.procs import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def redis_server_available() -> bool:
    """Whether a redis-server binary can be started."""
    return Path(REDIS_SERVER).is_file()


def _ping(port: int, timeout: float = 0.5) -> bool:
    """One raw RESP PING; True if the server answered +PONG."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _parent_death_signal() -> Callable[[], None] | None:
    """A preexec_fn making the child get SIGTERM if we die without cleaning up (Linux only).

    The kernel sends it when the *thread* that started the child exits, so it is only used when
    starting from the main thread. prctl is looked up here, in the parent, not after fork.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
        threading.main_thread()
    ):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))

    return preexec


class RedisServer:
    """Context manager owning one redis-server process; `url` is valid while it is entered."""

    def __init__(self, start_timeout: float = 10.0, attempts: int = 3) -> None:
        self.start_timeout = start_timeout
        self.attempts = attempts
        self.port = 0
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> str:
        """Start the server and return its URL (retries on a port lost to a race)."""
        if not redis_server_available():
            raise FileNotFoundError(f"redis-server not found at {REDIS_SERVER}")
        self._dir = tempfile.TemporaryDirectory(prefix="kvgate-redis-")
        last = ""
        for _ in range(self.attempts):
            port = free_port()
            log = Path(self._dir.name) / f"redis-{port}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1",
                     "--save", "", "--appendonly", "no", "--dir", self._dir.name,
                     "--protected-mode", "yes"],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    preexec_fn=_parent_death_signal(),
                )
            deadline = time.monotonic() + self.start_timeout
            while time.monotonic() < deadline and proc.poll() is None:
                if _ping(port):
                    self.proc, self.port = proc, port
                    self.url = f"redis://127.0.0.1:{port}/0"
                    return self.url
                time.sleep(0.05)
            _stop(proc)
            last = log.read_text(errors="replace")[-2000:]
        self._dir.cleanup()
        self._dir = None
        raise RuntimeError(f"redis-server did not answer PING; last log:\n{last}")

    def stop(self) -> None:
        """Stop the server (bounded) and remove its scratch directory."""
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _stop(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """SIGTERM (redis-server then exits without saving, --save ""), SIGKILL if it lingers."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)
