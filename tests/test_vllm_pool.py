"""`kvgate vllm-pool`'s argument checks, which fail before any engine starts (exit 2, the
problem named). The pool itself is exercised by tests/vllm_tier/test_real_nixl.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvgate.vllm_pool import PoolError, parse_cores


def test_cores_parse_lists_and_ranges_within_the_allowed_set() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert parse_cores(None) == allowed
    first = allowed[0]
    assert parse_cores(f"{first},{first}") == [first]
    assert parse_cores(f"{first}-{first}") == [first]
    with pytest.raises(PoolError, match="not a core number"):
        parse_cores("one")
    with pytest.raises(PoolError, match="not available"):
        parse_cores("4096")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgate.cli", "vllm-pool", *args],
                          capture_output=True, text=True, timeout=60)


def test_bad_arguments_exit_2_naming_the_problem() -> None:
    done = run("--engines", "0")
    assert done.returncode == 2 and "--engines must be at least 1" in done.stderr
    done = run("--cores", "4096")
    assert done.returncode == 2 and "--cores: 4096 not available" in done.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        done = run("--serve", str(s.getsockname()[1]))
    assert done.returncode == 2 and "is not free" in done.stderr
