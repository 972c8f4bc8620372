"""The command line reads well and its errors say what to do (real subprocesses)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate.cli import main
from kvgate.procs import free_port


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


def test_bench_help_names_every_policy() -> None:
    from kvgate.bench.runner import LIVE_ONLY_POLICIES
    from planner.core import planner_names

    out = kvgate("bench", "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for name in (*planner_names(), *LIVE_ONLY_POLICIES):
        assert name in text.replace("- ", "-"), name


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


def test_engines_beside_a_config_and_an_empty_key_variable_are_not_taken(
        tmp_path: Path, taken_port: int) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"engines:\n  - url: http://127.0.0.1:9\nport: {taken_port}\n"
                      "admin_key: a-good-admin-key-0123456789\n")
    out = kvgate("serve", "--config", str(config), "--engines", "http://127.0.0.1:10")
    assert out.returncode == 2 and "give --engines or --config, not both" in out.stderr
    # An empty $KVGATE_ADMIN_KEY used to replace the file's key, and the error blamed the file.
    # Here the file's key is taken, and the run goes on to fail on the port it names.
    env = dict(os.environ, KVGATE_ADMIN_KEY="", KVGATE_ENGINE_API_KEY="")
    out = subprocess.run([sys.executable, "-m", "kvgate.cli", "serve", "--config", str(config)],
                         capture_output=True, text=True, timeout=60, env=env)
    assert "admin_key" not in out.stderr and "engine_api_key" not in out.stderr, out.stderr
    assert f"cannot listen on 127.0.0.1:{taken_port}: the port is in use" in out.stderr, \
        out.stderr


def test_an_unknown_log_level_is_a_usage_error() -> None:
    out = kvgate("--log-level", "loud", "demo")
    assert out.returncode == 2 and "invalid choice: 'LOUD'" in out.stderr


@pytest.mark.parametrize(("argv", "problem"), [
    (["sim", "--port", "1", "--block-size", "0"], "--block-size must be positive"),
    (["sim", "--port", "1", "--kv-blocks", "0"], "argument --kv-blocks: must be at least 1"),
    # Each a traceback, a hang or memory without end before.
    (["sim", "--port", "70000"], "argument --port: a port is 0 to 65535"),
    (["sim", "--port", "1", "--kv-blocks", "99999999999"], "at most 100,000,000 blocks"),
    (["sim", "--port", "1", "--kv-drop-seqs", "a,b"], "argument --kv-drop-seqs: expected a"),
    (["bench", "--workload", "fanout", "--engines", "100000"],
     "--engines must be from 1 to 4096"),
    (["sim", "--port", "1", "--time-scale", "nan"],
     "argument --time-scale: must be a finite number above 0, got nan"),
    (["microbench", "placement", "--agents", "0"], "argument --agents: must be at least 1"),
    (["microbench", "index", "--iterations", "0"], "argument --iterations: must be at least 1"),
    (["bench", "--workload", "fanout", "--time-scale", "inf"],
     "argument --time-scale: must be a finite number above 0"),
    (["vllm-pool", "--health-timeout", "0"], "argument --health-timeout: must be a finite"),
    (["export-workflows", "--redis", "redis://127.0.0.1:1/0", "--static-tokens", "-5"],
     "argument --static-tokens: must be at least 0, got -5"),
    (["export-workflows", "--redis", "redis://127.0.0.1:1/0", "--since", "nan"],
     "--since must be a positive number of seconds"),
    (["demo", "--workers", "0"], "argument --workers: must be at least 1"),
    # Each of these used to run: the report kept one of two rows, a precision no search used,
    # or a traceback from urllib; placement started a gateway that refused its policy.
    (["bench", "--workload", "fanout", "--policy", "kvgate,round-robin,kvgate"],
     "--policy names kvgate more than once"),
    (["bench", "--workload", "fanout", "--goodput-precision", "0.01"],
     "--goodput-precision sets how finely --goodput searches: use it with --goodput"),
    (["bench", "--workload", "fanout", "--mode", "live", "--engine-urls", "notaurl"],
     "--engine-urls: engine url must look like http://HOST:PORT, got 'notaurl'"),
    (["bench", "--workload", "fanout", "--mode", "live", "--engine-urls",
      "http://127.0.0.1:99999"], "got 'http://127.0.0.1:99999'"),
    (["microbench", "server-cost", "--engine-url", "127.0.0.1:8000"],
     "--engine-url: engine url must look like http://HOST:PORT"),
    (["microbench", "placement", "--policy", "kvgate,nope"], "unknown policy 'nope'; known: "),
])
def test_numbers_that_make_no_sense_are_usage_errors(
        argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Each used to be taken: a default in its place (0 blocks), a traceback later (0 agents,
    # 0 iterations), or a run that could only fail (a zero health timeout).
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code  # type: ignore[assignment]
    assert code == 2
    assert problem in capsys.readouterr().err


def test_an_output_that_cannot_be_written_is_named_before_the_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-dir" / "out.yaml"
    for argv, problem in (
            (["bench", "--workload", "fanout", "--json", str(tmp_path)],
             f"--json {tmp_path}: is a directory"),
            (["bench", "--workload", "fanout", "--plot", str(missing)],
             f"no directory {missing.parent}"),
            # Checked before calibrating (minutes against a real engine); nothing listens here.
            (["calibrate", "--engine", "http://127.0.0.1:9", "--out", str(missing)],
             f"--out {missing}: no directory"),
            (["export-workflows", "--redis", "redis://127.0.0.1:1/0", "-o", str(tmp_path)],
             "--output"),
            (["microbench", "index", "--json", str(missing)], "--json"),
            (["serve", "--config", str(tmp_path / "file"), "--scheduling-policy", "priority"],
             "--scheduling-policy goes with --engines"),
            (["vllm-pool", "--run-dir", str(tmp_path / "file")], "is a file"),
            # A path the kernel will not create a file at, and a plot of no type it writes.
            (["bench", "--workload", "fanout", "--json", "/proc/kvgate.json"],
             "--json /proc/kvgate.json: cannot be written"),
            (["bench", "--workload", "fanout", "--plot", str(tmp_path / "plot.txt")],
             "a plot is eps, jpeg, jpg, pdf, png")):
        (tmp_path / "file").write_text("")
        assert main(argv) == 2, argv
        assert problem in capsys.readouterr().err, argv


@pytest.mark.parametrize("command", [["serve", "--engines", "http://127.0.0.1:9"], ["sim"]])
def test_a_tokenizer_that_cannot_load_is_not_called_a_listen_error(
        tmp_path: Path, command: list[str]) -> None:
    done = kvgate(*command, "--port", str(free_port()),
                  "--tokenizer", str(tmp_path / "no-such-tokenizer"))
    assert done.returncode == 1
    assert f"kvgate {command[0]}: cannot start:" in done.stderr
    assert "cannot listen" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("command", [
    ["serve", "--config"], ["sim", "--port", "9", "--profile-file"], ["bench", "--dag-file"]])
def test_a_file_nested_too_deeply_is_named_not_a_traceback(
        tmp_path: Path, command: list[str]) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 3000 + "]" * 3000 + "\n")
    done = kvgate(*command, str(deep))
    assert done.returncode == 2
    assert f"{deep}: not valid YAML: the document nests lists or mappings too deeply" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_kv_event_port_in_use_is_named(taken_port: int) -> None:
    done = kvgate("serve", "--engines", "http://127.0.0.1:9", "--port", str(free_port()),
                  "--kv-events-bind", f"tcp://127.0.0.1:{taken_port}")
    assert done.returncode == 1
    assert (f"kvgate serve: cannot bind the KV-event endpoint tcp://127.0.0.1:{taken_port}: "
            "Address already in use") in done.stderr
    assert "Traceback" not in done.stderr


def test_a_log_level_in_the_environment_that_is_none_is_named() -> None:
    done = subprocess.run([sys.executable, "-m", "kvgate.cli", "native", "status"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KVGATE_LOG_LEVEL": "verbose"})
    assert done.returncode == 2
    assert "$KVGATE_LOG_LEVEL is 'VERBOSE'; use debug, info, warning or error" in done.stderr


def test_ctrl_c_ends_a_command_without_a_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import kvgate.cli as cli

    def interrupted(_: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_native", interrupted)
    assert cli.main(["native", "status"]) == 130
    assert capsys.readouterr().err == "kvgate native: interrupted\n"


def test_a_demo_stopped_with_sigterm_stops_its_engines_and_gateway() -> None:
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "demo", "--engines", "2",
                             "--workers", "2", "--keep"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    urls = []
    for line in proc.stdout:  # until the pool is up and the summary printed
        if line.startswith("gateway "):
            urls = [u.strip(",;") for u in line.split() if u.startswith("http://")]
        if line.startswith("the pool keeps running"):
            break
    assert len(urls) == 3, urls  # the gateway and its two engines
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) in (0, 130)
    deadline = time.monotonic() + 15
    for url in urls:
        host, port = url.removeprefix("http://").split(":")
        while True:  # nothing listens there any more
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
            except OSError:
                break
            assert time.monotonic() < deadline, f"{url} still up"
            time.sleep(0.2)
