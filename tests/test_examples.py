"""Every example in examples/ runs as a script against a real gateway and simulated engines,
and its workflow shows up at the gateway (`GET /v1/workflows/{id}`) with the tasks it made."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvgate.procs import Child
from kvgate.sdk import Client
from tests.conftest import MODEL

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SUMMARY = re.compile(r"^workflow (\S+): (\w+), (\d+) tasks$", re.MULTILINE)


def run_example(name: str, gateway: Child, *extra: str) -> tuple[str, str]:
    """Run examples/NAME.py; its workflow id and its output."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--base-url", gateway.url,
         "--model", MODEL, "--max-tokens", "8", *extra],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env, check=False)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    match = SUMMARY.search(proc.stdout)
    assert match, f"{name} printed no workflow summary:\n{proc.stdout}"
    assert match.group(2) == "done"
    return match.group(1), proc.stdout


async def tasks_of(gateway: Child, workflow_id: str) -> dict[str, list[str]]:
    """The workflow's tasks at the gateway and their parents; each ran on an engine."""
    async with Client(gateway.url) as kv:
        snap = await kv.get(workflow_id)
    assert snap.source == "hints" and snap.state == "done"
    assert all(r["engine"] and r["state"] == "done" for r in snap.tasks.values())
    return {t: sorted(r["after"]) for t, r in snap.tasks.items()}


async def test_map_reduce_researcher_is_a_fan_out_and_a_join(gateway: Child) -> None:
    wf, out = run_example("map_reduce_researcher", gateway, "--workers", "3")
    assert wf.startswith("map-reduce-") and "engine=" in out
    assert await tasks_of(gateway, wf) == {
        "plan-1": [], "research-1": ["plan-1"], "research-2": ["plan-1"],
        "research-3": ["plan-1"], "reduce-1": ["research-1", "research-2", "research-3"]}


async def test_react_tool_loop_is_a_chain_of_turns(gateway: Child) -> None:
    wf, _ = run_example("react_tool_loop", gateway, "--turns", "4")
    tasks = await tasks_of(gateway, wf)
    n = len(tasks)
    assert 1 <= n <= 4
    assert tasks == {f"turn-{k}": [f"turn-{k - 1}"] if k > 1 else [] for k in range(1, n + 1)}


async def test_debate_rounds_are_fan_outs_each_joining_the_last(gateway: Child) -> None:
    wf, _ = run_example("debate", gateway, "--agents", "3", "--rounds", "2")
    round1 = ["agent-1", "agent-2", "agent-3"]
    round2 = ["agent-4", "agent-5", "agent-6"]
    assert await tasks_of(gateway, wf) == {**{a: [] for a in round1},
                                           **{a: round1 for a in round2}, "judge-1": round2}


async def test_langgraph_agent_branches_run_as_a_fan_out(gateway: Child) -> None:
    wf, _ = run_example("langgraph_agent", gateway)
    assert await tasks_of(gateway, wf) == {"plan-1": [], "pros-1": ["plan-1"],
                                           "cons-1": ["plan-1"],
                                           "write-1": ["cons-1", "pros-1"]}


async def test_openai_agents_sdk_agents_show_up_as_tasks(gateway: Child) -> None:
    wf, _ = run_example("openai_agents_sdk", gateway)
    tasks = await tasks_of(gateway, wf)
    # An analyst that calls its tool makes a second call (analyst-N.2) extending its first.
    assert {"analyst-1", "analyst-2", "editor-1"} <= tasks.keys()
    assert tasks["analyst-1"] == [] and tasks["analyst-2"] == []
    last = {a: max((t for t in tasks if t.split(".")[0] == a), key=len) for a in
            ("analyst-1", "analyst-2")}
    assert tasks["editor-1"] == sorted(last.values())


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("expression", "result"), [
    ("17 * 23 + 4", "395"), ("(1 + 2) ** 3 / 2", "13.5"), ("-7 // 2", "-4"),
    ("1 / 0", "error: division by zero"), ("__import__('os')", "error: unsupported"),
    ("2 ** 1000", "error: exponent too large"), ("17 *", "error: invalid syntax")])
def test_react_calculator_evaluates_arithmetic_and_refuses_anything_else(
    expression: str, result: str
) -> None:
    assert _load("react_tool_loop").calculate(expression).startswith(result)
