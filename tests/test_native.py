"""The compiled engine model (`kvgate native build`): loaded only for the source it was built
from, and the same results as the Python source (real mypyc build, real subprocesses)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import adapters.sim

ROOT = Path(__file__).resolve().parent.parent
EXT = sysconfig.get_config_var("EXT_SUFFIX")
SHOW = ("import adapters.sim as s, adapters.sim.model as m; "
        "print(s.native_path); print(m.__file__)")


def run(args: list[str], native: str, native_dir: Path,
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVGATE_NATIVE": native, "KVGATE_NATIVE_DIR": str(native_dir)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


def fake_build(root: Path, key: str) -> None:
    """Files named like a build of the engine model under `key`, holding no module."""
    directory = root / key / "adapters" / "sim"
    directory.mkdir(parents=True)
    for name in ("model", "model__mypyc"):
        (directory / f"{name}{EXT}").write_bytes(b"not a module")


def test_the_key_follows_the_source(tmp_path: Path) -> None:
    package = Path(adapters.sim.__file__).parent
    copy = tmp_path / "sim"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert adapters.sim.native_key(copy) == adapters.sim.native_key()
    model = copy / "model.py"
    model.write_text(model.read_text() + "\n# edited\n")
    assert adapters.sim.native_key(copy) != adapters.sim.native_key()


def test_a_build_for_another_source_is_never_loaded(tmp_path: Path) -> None:
    # Files named like a build, under a key no source has: `auto` runs the Python source.
    fake_build(tmp_path, "00000000000000000000")
    shown = run(["-c", SHOW], "auto", tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split() == ["None", str(ROOT / "adapters" / "sim" / "model.py")]
    assert "does not load" not in shown.stderr  # never even tried
    # `on` without a build for this source is an error that says how to make one.
    missing = run(["-c", SHOW], "on", tmp_path)
    assert missing.returncode != 0
    assert "kvgate native build" in missing.stderr
    bad = run(["-c", SHOW], "fast", tmp_path)
    assert bad.returncode != 0 and "KVGATE_NATIVE must be one of auto, on, off" in bad.stderr


def test_a_build_that_does_not_load_falls_back_to_the_source(tmp_path: Path) -> None:
    fake_build(tmp_path, adapters.sim.native_key())
    shown = run(["-c", SHOW], "auto", tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split() == ["None", str(ROOT / "adapters" / "sim" / "model.py")]
    assert "does not load" in shown.stderr and "kvgate native build --force" in shown.stderr
    # Asked for by name, the broken build is an error.
    assert run(["-c", SHOW], "on", tmp_path).returncode != 0


def test_the_compiled_engine_model_gives_the_same_results(tmp_path: Path) -> None:
    native_dir = tmp_path / "native"
    # `on` before there is a build: the commands that need it say how to make it, and
    # `native status` and `native build` work.
    unbuilt = run(["-m", "kvgate.cli", "bench", "--workload", "fanout", "--workflows", "2"],
                  "on", native_dir)
    assert unbuilt.returncode == 2 and "Traceback" not in unbuilt.stderr
    assert "no compiled engine model" in unbuilt.stderr
    assert "kvgate native build" in unbuilt.stderr
    status = run(["-m", "kvgate.cli", "native", "status"], "on", native_dir)
    assert status.returncode == 0 and "run `kvgate native build`" in status.stdout
    built = run(["-m", "kvgate.cli", "native", "build"], "on", native_dir, timeout=600)
    assert built.returncode == 0, built.stderr
    shown = run(["-c", SHOW], "on", native_dir)
    assert shown.returncode == 0, shown.stderr
    where, module = shown.stdout.split()
    assert module == str(Path(where) / f"model{EXT}")
    assert Path(where).is_relative_to(native_dir)
    status = run(["-m", "kvgate.cli", "native", "status"], "auto", native_dir)
    assert status.stdout.startswith("compiled engine model in use"), status.stdout

    # Seeded reports, byte for byte: a long claude-code session (100k-token turns, sub-agents,
    # the plain-decode shortcut, KV events for the index) and a long-context fan-out that moves
    # KV over a link (pulls, exports). Evictions: the engine model's tests below.
    benches = {
        "claude-code": ["--workload", "claude-code", "--workload-arg", "think_scale=0",
                        "--workflows", "1", "--profile", "h200-qwen3-32b", "--engines", "2",
                        "--policy", "kvgate"],
        "fanout-long": ["--workload", "fanout", "--profile", "h100x4-llama3-70b",
                        "--workload-arg", "context_tokens=32000", "--workflows", "8",
                        "--link", "rdma", "--policy", "kvgate,llmd-p2p-like,dynamo-like"],
    }
    for name, args in benches.items():
        reports = {}
        for native in ("off", "on"):
            out = tmp_path / f"{name}-{native}.json"
            done = run(["-m", "kvgate.cli", "bench", "--no-progress", *args, "--json", str(out)],
                       native, native_dir)
            assert done.returncode == 0, done.stderr
            said = "compiled engine model" if native == "on" else "engine model as Python"
            assert said in done.stdout
            reports[native] = out.read_text()
        assert json.loads(reports["on"])["results"], name
        assert reports["on"] == reports["off"], name

    # The engine model's own tests, against the compiled module.
    tests = run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_engine_model.py",
                 "tests/test_sim_priority.py"], "on", native_dir)
    assert tests.returncode == 0, tests.stdout[-3000:]
