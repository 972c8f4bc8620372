"""`kvgate export-workflows` turns served workflows into a `--workflow-trace` the bench replays
with the same DAGs, token counts and think times.

Real processes on 127.0.0.1: two `kvgate sim` engines, a `kvgate serve` gateway keeping its
workflows in a private redis-server, the exporter and `kvgate bench` as subprocesses.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from kvgate.bench.prompts import ChatRenderer, Vocabulary
from kvgate.bench.virtual import PromptBuilder
from kvgate.bench.workloads import load_workflow_trace
from kvgate.export import export
from kvgate.procs import Child, free_port, spawn, start_sim, wait_healthy
from kvindex.keys import PromptKeyer
from kvindex.tokenizer import Tokenizer
from tests.conftest import MODEL, ThreadedServer
from tests.redis_server import RedisServer, redis_server_available

NAMESPACE = "export-test"
SYSTEM = "You are a careful researcher who cites sources and checks every claim twice. " * 10


def call(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None
         ) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def fanout(think_s: float) -> dict[str, Any]:
    return {
        "id": "fanout", "model": MODEL,
        "segments": {"sys": {"kind": "static", "content": SYSTEM}},
        "tasks": [
            {"id": "plan", "output_tokens": 12,
             "messages": [{"segment": "sys"}, {"role": "user", "content": "Plan the survey."}]},
            *({"id": f"w{i}", "after": ["plan"], "output_tokens": 6 + i,
               "messages": [{"segment": "sys"}, {"output_of": "plan", "role": "user"},
                            {"role": "user", "content": f"Do part {i} of the plan."}]}
              for i in range(2)),
            {"id": "reduce", "output_tokens": 10, "think_time_s": think_s,
             "messages": [{"segment": "sys"}, {"output_of": "w0"}, {"output_of": "w1"},
                          {"role": "user", "content": "Combine the parts."}]},
        ],
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Two API workflows and one hint-mode agent, finished, on a gateway whose workflow store
    is a private Redis."""
    if not redis_server_available():
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    logs = tmp_path_factory.mktemp("export")
    with RedisServer() as redis_url:
        sims = [start_sim(f"export-sim-{i}", logs, ["--model", MODEL, "--seed", str(i),
                                                     "--enable-prompt-tokens-details"])
                for i in range(2)]
        port = free_port()
        config = {"host": "127.0.0.1", "port": port, "policy": "kvgate",
                  "engines": [{"url": s.url} for s in sims],
                  "workflows": {"store": "redis", "redis_url": redis_url,
                                "namespace": NAMESPACE}}
        path = logs / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        gw = spawn("export-gateway", ["serve", "--config", str(path)],
                   f"http://127.0.0.1:{port}", logs)
        try:
            wait_healthy(gw)
            ids = [submit_and_wait(gw, fanout(think_s=0.4 * i)) for i in range(2)]
            ids.append(hint_agent(gw))
            yield {"gateway": gw, "redis": redis_url, "ids": ids, "logs": logs,
                   "snapshots": {i: call("GET", f"{gw.url}/v1/workflows/{i}")[1] for i in ids}}
        finally:
            for c in [gw, *sims]:
                c.stop()


def wait_done(gw: Child, wf_id: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status, snap = call("GET", f"{gw.url}/v1/workflows/{wf_id}")
        assert status == 200, snap
        if snap["state"] == "done":
            return
        assert snap["state"] == "running", snap
        time.sleep(0.05)
    raise AssertionError(f"workflow {wf_id} did not finish")


def submit_and_wait(gw: Child, spec: dict[str, Any]) -> str:
    status, snap = call("POST", f"{gw.url}/v1/workflows", spec)
    assert status == 201, snap
    wait_done(gw, snap["id"])
    return str(snap["id"])


def hint_agent(gw: Child) -> str:
    """An agent's own calls, annotated: a plan, then two turns that extend it."""
    wf = f"agent-{time.monotonic_ns()}"
    system = {"role": "system", "content": SYSTEM}
    history: list[dict[str, str]] = [system, {"role": "user", "content": "Plan it."}]
    after: list[str] = []
    for i, task in enumerate(["plan", "step1", "step2"]):
        headers = {"x-kvgate-workflow": wf, "x-kvgate-task": task}
        if after:
            headers["x-kvgate-after"] = ",".join(after)
        status, body = call("POST", f"{gw.url}/v1/chat/completions",
                            {"model": MODEL, "max_tokens": 5 + i, "messages": history}, headers)
        assert status == 200, body
        history = [*history, {"role": "assistant", "content": body["choices"][0]["message"]
                              ["content"]}, {"role": "user", "content": f"Observation {i}."}]
        after = [task]
        time.sleep(0.3)  # the agent's own tool time: a think time in the trace
    wait_done(gw, wf)
    return wf


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgate.cli", *args], capture_output=True,
                          text=True, timeout=300)


def ancestors(task: str, after: dict[str, list[str]]) -> set[str]:
    out: set[str] = set()
    todo = list(after[task])
    while todo:
        t = todo.pop()
        if t not in out:
            out.add(t)
            todo.extend(after[t])
    return out


def builder() -> PromptBuilder:
    tok = Tokenizer.load()
    vocab = Vocabulary(tok)
    return PromptBuilder(vocab, ChatRenderer(tok, vocab), PromptKeyer(tok, 16))


def test_exported_workflows_replay_with_the_served_dags_and_token_counts(
    served: dict[str, Any], tmp_path: Path,
) -> None:
    out = tmp_path / "traffic.jsonl"
    done = run_cli("export-workflows", "--redis", served["redis"], "--namespace", NAMESPACE,
                   "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "exported 3 workflows (11 tasks)" in done.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == served["ids"]  # oldest first
    assert lines[0]["arrival_s"] == 0 and lines[1]["arrival_s"] < lines[2]["arrival_s"]
    b = builder()
    replayed = load_workflow_trace(out, b.vocab)
    assert len(replayed) == 3
    for wf, wf_id in zip(replayed, served["ids"], strict=True):
        recorded = served["snapshots"][wf_id]["tasks"]
        assert {t.id for t in wf.tasks} == set(recorded)
        for t in wf.tasks:
            rec = recorded[t.id]
            # A task that extends its parent's prompt carries its ancestors' outputs too, so
            # it may name them as well: the same DAG, ancestors for ancestors.
            assert set(rec["after"]) <= set(t.after)
            assert ancestors(t.id, {k: v["after"] for k, v in recorded.items()}) == \
                ancestors(t.id, {x.id: list(x.after) for x in wf.tasks})
            assert t.output_tokens == rec["output_tokens"]
            prompt = sum(len(p.ids) for p in b.pieces(wf, t))
            assert prompt == rec["prompt_tokens"], (wf_id, t.id)
    # Think times: the second fan-out's reducer waited 0.4 s, the agent 0.3 s between turns.
    reduce = next(t for t in replayed[1].tasks if t.id == "reduce")
    assert 0.35 <= reduce.think_time_s < 5
    agent = {t.id: t for t in replayed[2].tasks}
    assert 0.25 <= agent["step1"].think_time_s < 5 and agent["plan"].think_time_s == 0
    # A static segment shared by every workflow: the system prompt the roots found cached.
    assert all(line["segments"]["static"]["kind"] == "static" for line in lines)


def test_the_bench_replays_an_export_under_several_policies(
    served: dict[str, Any], tmp_path: Path,
) -> None:
    out, report = tmp_path / "traffic.jsonl", tmp_path / "report.json"
    assert run_cli("export-workflows", "--redis", served["redis"], "--namespace", NAMESPACE,
                   "-o", str(out)).returncode == 0
    done = run_cli("bench", "--workflow-trace", str(out), "--engines", "2",
                   "--policy", "kvgate,round-robin", "--json", str(report), "--no-progress")
    assert done.returncode == 0, done.stderr
    results = json.loads(report.read_text())["results"]
    for policy in ("kvgate", "round-robin"):
        assert results[policy]["workflows"] == 3
        assert results[policy]["requests"] == 11
        assert results[policy]["failed"] == 0


def test_since_and_limit_keep_the_newest_workflows(served: dict[str, Any],
                                                   tmp_path: Path) -> None:
    out = tmp_path / "newest.jsonl"
    done = run_cli("export-workflows", "--redis", served["redis"], "--namespace", NAMESPACE,
                   "--limit", "2", "--since", "3600", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == served["ids"][1:]


def test_export_through_the_gateway_list_endpoint(served: dict[str, Any],
                                                  tmp_path: Path) -> None:
    gw = served["gateway"]
    status, _ = call("GET", f"{gw.url}/v1/workflows?limit=1")
    if status in (404, 405):
        # The list endpoint comes with the timeline page; until then the exporter says so.
        done = run_cli("export-workflows", "--gateway", gw.url, "-o", str(tmp_path / "x"))
        assert done.returncode == 2 and "--redis URL --namespace NS" in done.stderr
        return
    out = tmp_path / "via-gateway.jsonl"
    done = run_cli("export-workflows", "--gateway", gw.url, "-o", str(out))
    assert done.returncode == 0, done.stderr
    ids = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert ids == served["ids"]


def test_a_listed_id_is_read_as_an_id_and_errors_never_show_the_key(
    threaded_server: Callable[[web.Application], ThreadedServer], tmp_path: Path,
) -> None:
    # A hint-mode id is the client's text: unquoted, this one made the exporter read
    # /metrics, and the JSON error it then printed showed the request's Authorization header.
    key = "admin-" + "k" * 26
    odd = "x/../../../metrics"
    seen: list[str] = []

    async def listing(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": odd}]})

    async def one(request: web.Request) -> web.Response:
        seen.append(request.raw_path)
        return web.json_response({**snapshot(), "id": request.match_info["id"]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="# not a workflow")

    app = web.Application()
    app.router.add_get("/v1/workflows", listing)
    app.router.add_get("/v1/workflows/{id}", one)
    app.router.add_get("/metrics", metrics)
    gw = threaded_server(app)
    out = tmp_path / "odd.jsonl"
    done = run_cli("export-workflows", "--gateway", gw.url, "--api-key", key, "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert seen == ["/v1/workflows/x%2F..%2F..%2F..%2Fmetrics"]
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [odd]
    app2 = web.Application()
    app2.router.add_get("/v1/workflows", listing)
    app2.router.add_get("/v1/workflows/{id}", metrics)
    done = run_cli("export-workflows", "--gateway", threaded_server(app2).url, "--api-key", key,
                   "-o", str(out))
    assert done.returncode == 2 and "did not answer JSON" in done.stderr
    assert key not in done.stderr


@pytest.mark.parametrize(("args", "message"), [
    ((), "exactly one of --gateway URL or --redis URL"),
    (("--gateway", "http://127.0.0.1:1", "--redis", "redis://127.0.0.1:1/0"),
     "exactly one of --gateway URL or --redis URL"),
    (("--redis", "redis://127.0.0.1:1/0"), "cannot read workflows from redis://127.0.0.1:1/0"),
    (("--gateway", "http://127.0.0.1:1"), "cannot reach http://127.0.0.1:1"),
    (("--redis", "redis://127.0.0.1:1/0", "--limit", "0"), "--limit must be positive"),
    (("--redis", "redis://127.0.0.1:1/0", "--since", "-5"), "--since must be a positive"),
])
def test_bad_sources_exit_2_naming_the_problem(args: tuple[str, ...], message: str) -> None:
    done = run_cli("export-workflows", *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def snapshot(state: str = "done", **task: Any) -> dict[str, Any]:
    rec = {"after": [], "ready_s": 10.0, "finished_s": 11.0, "prompt_tokens": 300,
           "output_tokens": 20, "cached_tokens": 0, **task}
    return {"id": f"wf-{state}-{len(task)}", "model": "m", "state": state, "created_s": 10.0,
            "tasks": {"t": rec}}


def test_unfinished_or_uncounted_workflows_are_skipped_with_the_reason() -> None:
    result = export([snapshot("running"), snapshot(output_tokens=None), snapshot()])
    assert len(result.lines) == 1
    assert result.skipped == ["wf-running-0: its state is 'running', not 'done'",
                              "wf-done-1: task 't' has no output_tokens"]


def test_a_prompt_shorter_than_its_framing_is_reported_inexact() -> None:
    result = export([snapshot(prompt_tokens=2)])
    assert result.inexact == ["wf-done-1/t"]
    assert result.lines[0]["tasks"][0]["messages"] == [{"segment": "task:t"}]
