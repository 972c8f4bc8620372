"""The command line reads well and its errors say what to do (real subprocesses)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest


def kvgate(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgate.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_help_lists_every_command_and_how_to_start() -> None:
    out = kvgate("--help")
    assert out.returncode == 0
    for command in ("serve", "sim", "demo", "bench", "microbench", "calibrate", "vllm-pool",
                    "export-workflows", "native"):
        assert f"    {command} " in out.stdout or f"    {command}\n" in out.stdout, command
    assert "getting started:" in out.stdout and "kvgate sim --port 8101" in out.stdout


def test_serve_without_engines_says_how_to_name_them() -> None:
    out = kvgate("serve")
    assert out.returncode == 2
    assert "--engines http://127.0.0.1:8101" in out.stderr and "kvgate sim" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("command", [["serve", "--engines", "http://127.0.0.1:9"], ["sim"]])
def test_a_port_in_use_is_named_with_what_to_do(command: list[str], taken_port: int) -> None:
    out = kvgate(*command, "--port", str(taken_port))
    assert out.returncode == 1
    assert f"cannot listen on 127.0.0.1:{taken_port}: the port is in use" in out.stderr
    assert "--port" in out.stderr and "Traceback" not in out.stderr


def test_a_bad_engine_url_and_an_unknown_policy_are_named() -> None:
    url = kvgate("serve", "--engines", "localhost:8000")
    assert url.returncode == 2
    assert "engines.0.url" in url.stderr and "http://HOST:PORT" in url.stderr
    policy = kvgate("serve", "--engines", "http://127.0.0.1:9", "--policy", "nope")
    assert policy.returncode == 2 and "unknown policy 'nope'; known:" in policy.stderr


def test_an_unknown_log_level_is_a_usage_error() -> None:
    out = kvgate("--log-level", "loud", "demo")
    assert out.returncode == 2 and "invalid choice: 'LOUD'" in out.stderr
