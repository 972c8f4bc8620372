"""The workflow API end to end: two real gateway replicas sharing one real redis-server, in
front of four real simulated engines. Workflows are submitted over HTTP, run through the
gateway's own routing, streamed as SSE, read and cancelled from either replica."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import WorkflowSettings
from gateway.workflow_store import MemoryWorkflowStore
from gateway.workflows import TaskOutcome, WorkflowService
from kvgate.procs import Child, free_port, spawn, start_sim, wait_healthy
from planner.hints import AFTER_HEADER, TASK_HEADER, parse_hints
from tests.conftest import MODEL
from tests.redis_server import RedisServer, redis_server_available

MAX_TASKS = 20
MAX_BODY = 64 * 1024
CALL_BODY = 256 * 1024
SYSTEM = "You are a careful researcher who cites sources. " * 12


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("workflow-api")


@pytest.fixture(scope="module")
def engines(logs: Path) -> Iterator[list[Child]]:
    children = [start_sim(f"wf-sim-{i}", logs, ["--model", MODEL, "--seed", str(i),
                                                 "--enable-prompt-tokens-details"])
                for i in range(4)]
    yield children
    for c in children:
        c.stop()


@pytest.fixture(scope="module")
def replicas(engines: list[Child], logs: Path) -> Iterator[tuple[Child, Child]]:
    """Gateways A and B: same engines, one Redis for workflow state."""
    if not redis_server_available():
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    with RedisServer() as redis_url:
        children = []
        for name in ("a", "b"):
            port = free_port()
            # least-loaded with a slow scrape: load is the gateway's own in-flight count, so
            # equally idle engines take turns and a fan-out spreads over all of them.
            config = {"host": "127.0.0.1", "port": port, "policy": "least-loaded",
                      "max_body_bytes": CALL_BODY,
                      "scrape_interval_s": 60, "engines": [{"url": e.url} for e in engines],
                      "workflows": {"store": "redis", "redis_url": redis_url,
                                    "max_tasks": MAX_TASKS, "max_body_bytes": MAX_BODY,
                                    "replica": f"replica-{name}"}}
            path = logs / f"gateway-{name}.yaml"
            path.write_text(yaml.safe_dump(config))
            child = spawn(f"gateway-{name}", ["serve", "--config", str(path)],
                          f"http://127.0.0.1:{port}", logs)
            children.append(child)
        try:
            for c in children:
                wait_healthy(c)
            yield children[0], children[1]
        finally:
            for c in children:
                c.stop()


def call(method: str, url: str, body: Any = None, raw: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def sse(url: str) -> list[dict[str, Any]]:
    """Every event of a workflow's stream, until the server ends it."""
    events = []
    with urllib.request.urlopen(url, timeout=120) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
    return events


def wait_for(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.05)


def engine_figures(engine: Child) -> dict[str, float]:
    """Requests running at the engine, and requests it finished so far (vLLM counts none for
    a request aborted: it just leaves)."""
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {"running": 0.0, "finished": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                out["running"] += s.value
            if s.name == "vllm:request_success_total":
                out["finished"] += s.value
    return out


def fanout(workers: int = 4, output_tokens: int = 8) -> dict[str, Any]:
    return {
        "id": "fanout", "model": MODEL,
        "segments": {"sys": {"kind": "static", "content": SYSTEM}},
        "tasks": [
            {"id": "plan", "output_tokens": output_tokens,
             "messages": [{"segment": "sys"}, {"role": "user", "content": "Plan the survey."}]},
            *({"id": f"w{i}", "after": ["plan"], "output_tokens": output_tokens,
               "messages": [{"segment": "sys"}, {"output_of": "plan", "role": "user"},
                            {"role": "user", "content": f"Do part {i}."}]}
              for i in range(workers)),
            {"id": "reduce", "output_tokens": output_tokens,
             "messages": [{"segment": "sys"}, *({"output_of": f"w{i}"} for i in range(workers))]},
        ],
    }


def submit(gateway: Child, spec: dict[str, Any]) -> dict[str, Any]:
    status, headers, snap = call("POST", f"{gateway.url}/v1/workflows", spec)
    assert status == 201, snap
    assert headers["Location"] == f"/v1/workflows/{snap['id']}"
    return dict(snap)


def read(gateway: Child, wf_id: str) -> dict[str, Any]:
    status, _, snap = call("GET", f"{gateway.url}/v1/workflows/{wf_id}")
    assert status == 200, snap
    return dict(snap)


# -- a workflow runs ------------------------------------------------------------------------------


def test_a_fanout_runs_spread_over_engines_streamed_and_readable_from_both_replicas(
    replicas: tuple[Child, Child], engines: list[Child],
) -> None:
    a, b = replicas
    snap = submit(a, fanout())
    wf = snap["id"]
    assert wf.startswith("fanout-") and snap["state"] == "running"
    assert snap["source"] == "api" and snap["replica"] == "replica-a"
    assert {t: r["state"] for t, r in snap["tasks"].items()} == dict.fromkeys(
        ["plan", "w0", "w1", "w2", "w3", "reduce"], "blocked")
    with ThreadPoolExecutor(2) as pool:
        here, there = (pool.submit(sse, f"{g.url}/v1/workflows/{wf}/events") for g in (a, b))
        events_a, events_b = here.result(120), there.result(120)

    assert events_a == events_b
    assert events_a[-1] == {"type": "workflow", "workflow": wf, "state": "done",
                            "finished_s": events_a[-1]["finished_s"]}
    by_task: dict[str, list[str]] = {}
    for e in events_a[:-1]:
        assert (e["type"], e["workflow"]) == ("task", wf)
        by_task.setdefault(e["task"], []).append(e["state"])
    lifecycle = ["thinking", "ready", "running", "done"]
    assert by_task == {t: lifecycle for t in ("plan", "w0", "w1", "w2", "w3", "reduce")}

    final = read(b, wf)
    assert final == read(a, wf)
    assert final["state"] == "done" and final["finished_s"] >= final["created_s"]
    tasks = final["tasks"]
    names = {e.url.removeprefix("http://") for e in engines}
    assert {tasks[f"w{i}"]["engine"] for i in range(4)} == names
    for task_id, t in tasks.items():
        assert t["request_id"] == f"{wf}/{task_id}"
        assert t["output_tokens"] == 8 and t["output"]
        assert t["prompt_tokens"] > 100 and t["cached_tokens"] is not None
        assert t["ready_s"] <= t["dispatched_s"] <= t["finished_s"]
        # Tasks are streamed through the gateway, so their first token is seen as it comes.
        assert t["dispatched_s"] <= t["first_token_s"] <= t["finished_s"]
    assert tasks["w2"]["after"] == ["plan"]
    assert tasks["reduce"]["after"] == ["w0", "w1", "w2", "w3"]
    assert tasks["reduce"]["ready_s"] >= max(tasks[f"w{i}"]["finished_s"] for i in range(4))


def test_a_late_subscriber_gets_the_whole_history(replicas: tuple[Child, Child]) -> None:
    a, b = replicas
    wf = submit(a, fanout(workers=2))["id"]
    wait_for(lambda: read(a, wf)["state"] == "done")
    events = sse(f"{b.url}/v1/workflows/{wf}/events")
    assert [e["state"] for e in events if e.get("task") == "plan"] == [
        "thinking", "ready", "running", "done"]
    assert events[-1]["type"] == "workflow" and len(events) == 4 * 4 + 1


def test_a_reader_resuming_after_the_final_event_gets_the_end_at_once(
    replicas: tuple[Child, Child],
) -> None:
    a, b = replicas
    wf = submit(a, fanout(workers=1))["id"]
    wait_for(lambda: read(a, wf)["state"] == "done")
    with urllib.request.urlopen(f"{a.url}/v1/workflows/{wf}/events", timeout=30) as r:
        ids = [line[3:].strip().decode() for line in r if line.startswith(b"id:")]
    for last in (ids[-1], ids[-2]):
        req = urllib.request.Request(f"{b.url}/v1/workflows/{wf}/events",
                                     headers={"Last-Event-ID": last})
        # It used to wait for an event that would never come (until the workflow expired).
        with urllib.request.urlopen(req, timeout=10) as r:
            rest = [json.loads(line[6:]) for line in r if line.startswith(b"data: ")]
        assert [e["type"] for e in rest] == ([] if last == ids[-1] else ["workflow"]), rest


def test_a_reader_that_leaves_early_ends_its_stream_quietly(
    replicas: tuple[Child, Child],
) -> None:
    a, _ = replicas
    spec = fanout(workers=1)
    spec["tasks"][-1]["think_time_s"] = 1.0  # the stream is still being written after we go
    wf = submit(a, spec)["id"]
    host, port = a.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"GET /v1/workflows/{wf}/events HTTP/1.1\r\nHost: gw\r\n\r\n".encode())
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    wait_for(lambda: read(a, wf)["state"] == "done")
    time.sleep(0.5)
    with urllib.request.urlopen(f"{a.url}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert 'route="/v1/workflows/{id}/events",status="500"' not in metrics
    assert "unhandled error" not in a.log_tail(400)


def test_the_location_of_a_workflow_is_a_path_to_it(replicas: tuple[Child, Child]) -> None:
    a, _ = replicas
    spec = {**fanout(workers=1), "id": "q?x#y"}
    status, headers, snap = call("POST", f"{a.url}/v1/workflows", spec)
    assert status == 201
    assert headers["Location"] == "/v1/workflows/" + urllib.parse.quote(snap["id"], safe="")
    status, _, again = call("GET", a.url + headers["Location"])
    assert status == 200 and again["id"] == snap["id"]
    wait_for(lambda: read(a, urllib.parse.quote(snap["id"], safe=""))["state"] == "done")


def test_without_tenants_a_clients_salt_is_shown_only_as_a_label(
    replicas: tuple[Child, Child],
) -> None:
    # Every record is readable without tenants: a salt shown as it is would let any reader
    # send calls under it and share that client's cache.
    from gateway.tenants import salt_label

    a, b = replicas
    wf = submit(a, {**fanout(workers=1), "tenant": "secret-salt-1"})["id"]
    status, _, _ = call("POST", f"{a.url}/v1/chat/completions",
                        {"model": MODEL, "max_tokens": 2, "cache_salt": "secret-salt-2",
                         "messages": [{"role": "user", "content": "hi"}]},
                        headers={"X-KVGate-Workflow": "salted-agent"})
    assert status == 200
    wait_for(lambda: read(a, wf)["state"] == "done")
    assert read(b, wf)["tenant"] == salt_label("secret-salt-1")
    assert read(b, "salted-agent")["tenant"] == salt_label("secret-salt-2")
    status, _, listing = call("GET", f"{b.url}/v1/workflows?limit=100")
    assert status == 200 and "secret-salt" not in json.dumps(listing)


def test_a_failing_task_skips_its_dependents_and_fails_the_workflow(
    replicas: tuple[Child, Child],
) -> None:
    a, _ = replicas
    spec = {"model": MODEL, "tasks": [
        {"id": "a", "output_tokens": 4, "messages": [{"role": "user", "content": "Start."}]},
        {"id": "bad", "after": ["a"], "params": {"min_tokens": -1},
         "messages": [{"role": "user", "content": "This call is invalid."}]},
        {"id": "child", "after": ["bad"], "messages": [{"role": "user", "content": "x"}]},
        {"id": "grandchild", "messages": [{"output_of": "child"}]},
        {"id": "sibling", "after": ["a"], "output_tokens": 4,
         "messages": [{"role": "user", "content": "Fine."}]},
    ]}
    wf = submit(a, spec)["id"]
    events = sse(f"{a.url}/v1/workflows/{wf}/events")
    assert events[-1]["state"] == "failed"
    tasks = read(a, wf)["tasks"]
    assert tasks["bad"]["state"] == "failed"
    assert tasks["bad"]["error"].startswith("HTTP 400") and "min_tokens" in tasks["bad"]["error"]
    for skipped in ("child", "grandchild"):
        assert tasks[skipped]["state"] == "skipped"
        assert tasks[skipped]["error"] == "skipped: task 'bad' failed"
    assert (tasks["a"]["state"], tasks["sibling"]["state"]) == ("done", "done")


# -- cancelling -----------------------------------------------------------------------------------


def long_workflow() -> dict[str, Any]:
    return {"model": MODEL, "tasks": [
        {"id": "long", "output_tokens": 4000,
         "messages": [{"role": "user", "content": "Write a very long essay."}]},
        {"id": "after", "after": ["long"], "messages": [{"role": "user", "content": "x"}]},
    ]}


def start_long_task(gateway: Child, engines: list[Child]) -> tuple[str, float]:
    """A workflow whose first task is generating at an engine; the requests the engines
    finished so far."""
    assert sum(engine_figures(e)["running"] for e in engines) == 0
    finished = sum(engine_figures(e)["finished"] for e in engines)
    wf = submit(gateway, long_workflow())["id"]
    wait_for(lambda: sum(engine_figures(e)["running"] for e in engines) == 1)
    return wf, finished


def assert_cancelled_and_aborted(snap: dict[str, Any], engines: list[Child],
                                 finished_before: float) -> None:
    """The long task's 4,000-token answer left its engine without being finished there."""
    assert snap["state"] == "cancelled" and snap["finished_s"] is not None
    assert {t: r["state"] for t, r in snap["tasks"].items()} == {"long": "cancelled",
                                                                 "after": "cancelled"}
    wait_for(lambda: sum(engine_figures(e)["running"] for e in engines) == 0)
    assert sum(engine_figures(e)["finished"] for e in engines) == finished_before


def test_delete_aborts_the_running_request_at_its_engine(
    replicas: tuple[Child, Child], engines: list[Child],
) -> None:
    a, _ = replicas
    wf, finished = start_long_task(a, engines)
    status, _, snap = call("DELETE", f"{a.url}/v1/workflows/{wf}")
    assert status == 200, snap
    assert_cancelled_and_aborted(snap, engines, finished)
    events = sse(f"{a.url}/v1/workflows/{wf}/events")
    assert events[-1]["state"] == "cancelled"
    assert [(e["task"], e["state"]) for e in events[-3:-1]] == [("long", "cancelled"),
                                                                 ("after", "cancelled")]


def test_delete_on_the_other_replica_cancels_where_it_runs(
    replicas: tuple[Child, Child], engines: list[Child],
) -> None:
    a, b = replicas
    wf, finished = start_long_task(a, engines)
    status, _, snap = call("DELETE", f"{b.url}/v1/workflows/{wf}")
    assert status == 200, snap
    assert_cancelled_and_aborted(snap, engines, finished)
    assert read(a, wf)["state"] == "cancelled"


def test_delete_of_a_workflow_already_over_is_a_conflict(replicas: tuple[Child, Child]) -> None:
    a, b = replicas
    wf = submit(a, fanout(workers=1))["id"]
    wait_for(lambda: read(a, wf)["state"] == "done")
    for g in (a, b):
        status, _, body = call("DELETE", f"{g.url}/v1/workflows/{wf}")
        assert status == 409
        assert body["error"]["message"] == f"workflow {wf!r} is already done"


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_an_unknown_workflow_is_a_404_naming_it(replicas: tuple[Child, Child],
                                                method: str) -> None:
    status, _, body = call(method, f"{replicas[1].url}/v1/workflows/wf-nope")
    assert status == 404
    assert body["error"]["code"] == "workflow_not_found"
    assert "'wf-nope'" in body["error"]["message"]


def test_events_of_an_unknown_workflow_are_a_404(replicas: tuple[Child, Child]) -> None:
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{replicas[0].url}/v1/workflows/wf-nope/events", timeout=30)
    assert info.value.code == 404


# -- bad submissions ------------------------------------------------------------------------------


def mutated(change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    spec = fanout(workers=2)
    change(spec)
    return spec


@pytest.mark.parametrize(("spec", "message"), [
    (mutated(lambda s: s["tasks"][0].update(after=["reduce"])), "the task graph has a cycle"),
    (mutated(lambda s: s["tasks"][1].update(after=["ghost"])),
     "task 'w0' runs after unknown task 'ghost'"),
    (mutated(lambda s: s["tasks"][-1]["messages"].append({"output_of": "gone"})),
     "task 'reduce' uses the output of unknown task 'gone'"),
    (mutated(lambda s: s["tasks"][0]["messages"].append({"segment": "nosuch"})),
     "task 'plan' refers to unknown segment 'nosuch'"),
    (mutated(lambda s: s["segments"].update(pad={"kind": "shared", "tokens": 300})),
     "segments 'pad' have synthetic `tokens`"),
    (mutated(lambda s: s.update(tasks=[{"id": f"t{i}", "messages": [{"role": "user",
                                                                      "content": "x"}]}
                                       for i in range(MAX_TASKS + 1)])),
     f"the workflow has {MAX_TASKS + 1} tasks; the limit is {MAX_TASKS}"),
    (mutated(lambda s: s.update(model="no-such-model")), "model 'no-such-model' is not served"),
    ([1, 2, 3], "request body must be a JSON object"),
    # Numbers the planner could not price, and fields a live run could not send.
    (mutated(lambda s: s["tasks"][0].update(max_tokens=10**400)),
     "tasks.0.max_tokens: Input should be less than or equal to 2147483647"),
    (mutated(lambda s: s["tasks"][1].update(think_time_s=float("inf"))),
     "tasks.1.think_time_s: Input should be a finite number"),
    (mutated(lambda s: s["tasks"][1].update(think_time_s=1e306)),
     "tasks.1.think_time_s: Input should be less than or equal to 86400"),
    (mutated(lambda s: s["tasks"][0].update(priority=10**12)),
     "tasks.0.priority: Input should be less than or equal to 1000000"),
    (mutated(lambda s: s.update(id="survey\r\nX-Evil: 1")),
     "workflow id 'survey\\r\\nX-Evil: 1' may hold printable ASCII"),
    (mutated(lambda s: s.update(id="s" * 200)), "(at most 128 characters)"),
    (mutated(lambda s: s.update(id="team/survey")), "workflow id 'team/survey' may"),
    (mutated(lambda s: s["tasks"][0].update(params={"kvgate": {"workflow": "other"}})),
     "task 'plan': params may not set kvgate"),
    # The tenant is the calls' salt: a task may not unsalt itself, and vLLM takes no empty one.
    (mutated(lambda s: s.update(tenant="acme") or s["tasks"][0].update(
        params={"cache_salt": None})), "task 'plan': params may not set cache_salt"),
    (mutated(lambda s: s.update(tenant="")), "tenant: String should have at least 1 character"),
    # What the engine would refuse with a 400 only once the workflow ran.
    (mutated(lambda s: s.update(tenant="team/a@b")), "which vLLM refuses with `@`, `/`"),
    (mutated(lambda s: s["segments"].update(kit={"kind": "static", "tools": [
        {"type": "function"}]})), "tool 0 must be {\"type\": \"function\""),
    (mutated(lambda s: s["tasks"][0]["messages"].append({"role": "banana", "content": "x"})),
     "Input should be 'system', 'developer', 'user', 'assistant' or 'tool'"),
    # A segment sent whole in each of the calls that use it: a spec under its limit whose
    # calls are over the gateway's (max_body_bytes).
    (mutated(lambda s: s["segments"].update(big={"kind": "shared", "content": "z" * 40_000})
             or s["tasks"][0]["messages"].extend([{"segment": "big"}] * 8)),
     "task 'plan''s call would be at least"),
])
def test_an_invalid_workflow_is_a_400_naming_the_problem(
    replicas: tuple[Child, Child], spec: Any, message: str,
) -> None:
    status, _, body = call("POST", f"{replicas[0].url}/v1/workflows", spec)
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error"
    assert message in body["error"]["message"]


def test_ids_that_name_the_stores_own_keys_are_unknown_and_unlabelled(
    replicas: tuple[Child, Child],
) -> None:
    # The replicas share a Redis store, whose own keys sit beside the workflows' hashes: reads
    # of those names were 500s (WRONGTYPE), and every 404's raw path became a metrics series.
    a, _ = replicas
    wf = submit(a, fanout(workers=1))["id"]
    for name in ("index", "running", f"{wf}:ev", f"{wf}:lease"):
        for path in (f"/v1/workflows/{name}", f"/v1/workflows/{name}/events"):
            status, _, body = call("GET", f"{a.url}{path}")
            assert status == 404 and "no workflow" in body["error"]["message"], (path, body)
    status, _, body = call("POST", f"{a.url}/v1/chat/completions",
                           {"model": MODEL, "max_tokens": 1,
                            "messages": [{"role": "user", "content": "hi"}]},
                           headers={"X-KVGate-Workflow": "index"})
    assert status == 400 and "workflow id 'index' is reserved" in body["error"]["message"]
    # `GET /v1/workflows/..` resolves to another path: such an id could never be read back.
    for dots in (".", ".."):
        status, _, body = call("POST", f"{a.url}/v1/chat/completions",
                               {"model": MODEL, "max_tokens": 1,
                                "messages": [{"role": "user", "content": "hi"}]},
                               headers={"X-KVGate-Workflow": dots})
        assert status == 400 and "resolved away in a URL" in body["error"]["message"]
    with urllib.request.urlopen(f"{a.url}/metrics", timeout=10) as r:
        routes = {s.labels["route"] for f in text_string_to_metric_families(r.read().decode())
                  for s in f.samples if s.name == "kvgate_requests_total"}
    assert "/v1/workflows/{id}" in routes and not any(":ev" in r or "index" in r for r in routes)
    wait_for(lambda: read(a, wf)["state"] == "done")


def test_bad_listing_limits_event_ids_and_forwarded_headers_are_400(
    replicas: tuple[Child, Child],
) -> None:
    a, _ = replicas
    for limit in ("%C2%B2", "9" * 5000, "0"):  # "²" passes str.isdigit
        status, _, body = call("GET", f"{a.url}/v1/workflows?limit={limit}")
        assert status == 400 and "limit must be an integer" in body["error"]["message"], body
    wf = submit(a, fanout(workers=1))["id"]
    for last in ("abc", "\u00b2", "1" * 30):
        req = urllib.request.Request(f"{a.url}/v1/workflows/{wf}/events",
                                     headers={"Last-Event-ID": last.encode()})  # type: ignore[dict-item]
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        assert info.value.code == 400
        message = json.loads(info.value.read())["error"]["message"]
        assert "Last-Event-ID must be an event id" in message
    # An Authorization header goes with every task's call: one that is not ASCII is refused
    # up front, not accepted and then failed task by task.
    status, _, body = call("POST", f"{a.url}/v1/workflows", fanout(workers=1),
                           headers={"Authorization": "Bearer \u6771\u4eac".encode()})  # type: ignore[dict-item]
    assert status == 400 and "header Authorization must be ASCII" in body["error"]["message"]
    wait_for(lambda: read(a, wf)["state"] == "done")


class _Sent:
    """An executor that answers every task at once and keeps what each was sent."""

    def __init__(self) -> None:
        self.calls: dict[str, tuple[dict[str, Any], dict[str, str]]] = {}

    async def execute(self, body: dict[str, Any], headers: Mapping[str, str]) -> TaskOutcome:
        self.calls[headers[TASK_HEADER]] = (body, dict(headers))
        return TaskOutcome(200, {"choices": [{"message": {"content": "ok"}}],
                                 "usage": {"prompt_tokens": 5, "completion_tokens": 1}})


async def test_a_join_too_wide_for_a_header_sends_its_parents_in_the_body() -> None:
    # 19 parents of 120-character ids: 2,298 characters, over what the executor puts in
    # X-KVGate-After (2,048; aiohttp refuses a header field over 8,190 bytes, which a
    # 1,000-task join of 128-character ids would pass many times over).
    ids = [f"branch-{i:02d}-" + "x" * 110 for i in range(19)]
    spec = {"id": "wide", "model": MODEL, "tasks": [
        *({"id": t, "messages": [{"role": "user", "content": f"Part {t}"}]} for t in ids),
        {"id": "pair", "after": ids[:2], "messages": [{"role": "user", "content": "Two."}]},
        {"id": "join", "messages": [{"role": "user", "content": "Join."},
                                    *({"output_of": t} for t in ids)]},
    ]}
    sent = _Sent()
    service = WorkflowService(WorkflowSettings(), MemoryWorkflowStore(), sent, replica="here")
    try:
        wf = (await service.submit(spec))["id"]
        for _ in range(200):
            if (await service.snapshot(wf))["state"] != "running":
                break
            await asyncio.sleep(0.01)
        assert (await service.snapshot(wf))["state"] == "done"
    finally:
        await service.stop()
    body, headers = sent.calls["join"]
    assert AFTER_HEADER not in headers and body["kvgate"] == {"after": ids}
    # The proxy reads it as it reads the header, and strips it before the engine sees it.
    hints, forwarded = parse_hints(CIMultiDict(headers), body)
    assert hints.after == tuple(ids) and hints.task == "join"
    assert forwarded is not None and "kvgate" not in forwarded
    body, headers = sent.calls["pair"]
    assert headers[AFTER_HEADER] == ",".join(ids[:2]) and "kvgate" not in body


def test_malformed_json_is_a_400(replicas: tuple[Child, Child]) -> None:
    status, _, body = call("POST", f"{replicas[0].url}/v1/workflows", raw=b'{"model": ')
    assert status == 400
    assert body["error"]["message"].startswith("request body is not valid JSON")


def test_an_oversized_body_is_a_413(replicas: tuple[Child, Child]) -> None:
    spec = fanout(workers=1)
    spec["segments"]["sys"]["content"] = "x" * (MAX_BODY + 1)
    status, _, body = call("POST", f"{replicas[0].url}/v1/workflows", spec)
    assert status == 413
    assert f"the limit is {MAX_BODY} bytes" in body["error"]["message"]


# -- hint mode: plain OpenAI calls that name their workflow ---------------------------------


def test_hint_mode_agent_with_the_openai_client_shows_up_as_a_workflow(
    replicas: tuple[Child, Child],
) -> None:
    import openai

    a, b = replicas
    client = openai.OpenAI(base_url=f"{a.url}/v1", api_key="unused")
    wf = f"agent-{time.monotonic_ns()}"
    system = {"role": "system", "content": "You plan, then your workers research. " * 20}
    plan = client.chat.completions.create(
        model=MODEL, max_tokens=8, messages=[system, {"role": "user", "content": "Plan it."}],
        extra_headers={"X-KVGate-Workflow": wf, "X-KVGate-Task": "plan",
                       "X-KVGate-Expect-Children": "2"})
    plan_text = plan.choices[0].message.content or ""
    for i in range(2):
        worker = client.chat.completions.create(
            model=MODEL, max_tokens=8, stream=(i == 1),
            messages=[system, {"role": "assistant", "content": plan_text},
                      {"role": "user", "content": f"Research part {i}."}],
            extra_body={"kvgate": {"workflow": wf, "task": f"worker{i}", "after": ["plan"],
                                   "priority": 1}})
        if i == 1:
            assert "".join(c.choices[0].delta.content or "" for c in worker if c.choices)
    # Readable from the other replica (Redis), with each call's place and outcome.
    status, _, snap = call("GET", f"{b.url}/v1/workflows/{wf}")
    assert status == 200, snap
    assert snap["source"] == "hints" and snap["id"] == wf
    deadline = time.monotonic() + 30
    while True:
        tasks = call("GET", f"{b.url}/v1/workflows/{wf}")[2]["tasks"]
        if all(t["state"] == "done" for t in tasks.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert all(t["state"] == "done" for t in tasks.values()), {
        k: (t["state"], t["error"]) for k, t in tasks.items()}
    assert set(tasks) == {"plan", "worker0", "worker1"}
    assert tasks["worker0"]["after"] == ["plan"] and tasks["plan"]["after"] == []
    assert all(t["engine"] for t in tasks.values())
    assert tasks["plan"]["output"] == plan_text
    assert tasks["worker1"]["first_token_s"] is not None  # streamed
    # The planner tagged the workers' prompts: the system prompt static, the planner's context
    # (which it said two children extend) shared, each worker's own ask transient.
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=2,
        messages=[system, {"role": "assistant", "content": plan_text},
                  {"role": "user", "content": "Research part 2, at length. " * 4}],
        extra_headers={"X-KVGate-Workflow": wf, "X-KVGate-Task": "worker2",
                       "X-KVGate-After": "plan"})
    seg = dict(kv.split("=") for kv in raw.headers["x-kvgate-segments"].split(","))
    assert int(seg["static"]) > 0 and int(seg["shared"]) > 0 and int(seg["transient"]) > 0


def test_bad_hints_are_a_400_naming_them(replicas: tuple[Child, Child]) -> None:
    a, _ = replicas
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    status, _, err = call("POST", f"{a.url}/v1/chat/completions",
                          {**body, "kvgate": {"workflow": "w", "colour": "red"}})
    assert status == 400 and "unknown keys: colour" in err["error"]["message"]
    status, _, err = call("POST", f"{a.url}/v1/chat/completions", body,
                          headers={"X-KVGate-Workflow": "w",
                                   "X-KVGate-Expect-Children": "many"})
    assert status == 400 and "X-KVGate-Expect-Children" in err["error"]["message"]
    status, _, err = call("POST", f"{a.url}/v1/chat/completions", body,
                          headers={"X-KVGate-Task": "t"})
    assert status == 400 and "needs a workflow id" in err["error"]["message"]


def test_a_streamed_task_answer_is_put_back_together_as_the_non_streamed_one() -> None:
    from gateway.workflows import _StreamedAnswer

    answer = _StreamedAnswer()
    chunks = [
        {"id": "chatcmpl-1", "created": 7, "model": MODEL,
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Looking "}}]},
        {"choices": [{"index": 0, "delta": {"content": "it up."}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_a", "type": "function",
             "function": {"name": "web_search", "arguments": "{\"query\": "}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 1, "id": "call_b", "function": {"name": "read_page", "arguments": "{}"}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": "\"kv\"}"}}]}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5,
                                  "prompt_tokens_details": {"cached_tokens": 8}}},
    ]
    for c in chunks:
        answer.feed(b"data: " + json.dumps(c).encode() + b"\n")
        answer.feed(b"\n")
    assert not answer.done
    answer.feed(b"data: [DONE]\n")
    doc = answer.completion()
    assert answer.done and answer.error is None
    assert doc["id"] == "chatcmpl-1" and doc["model"] == MODEL
    message = doc["choices"][0]["message"]
    assert message["content"] == "Looking it up."
    assert message["tool_calls"] == [
        {"id": "call_a", "type": "function",
         "function": {"name": "web_search", "arguments": "{\"query\": \"kv\"}"}},
        {"id": "call_b", "type": "function", "function": {"name": "read_page", "arguments": "{}"}},
    ]
    assert doc["choices"][0]["finish_reason"] == "tool_calls"
    assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == 8


def test_an_error_event_in_a_task_stream_is_the_tasks_error() -> None:
    from gateway.workflows import _StreamedAnswer

    answer = _StreamedAnswer()
    answer.feed(b'data: {"choices": [{"index": 0, "delta": {"content": "par"}}]}\n')
    answer.feed(b'data: {"error": {"message": "engine 127.0.0.1:9 died mid-stream", '
                b'"type": "upstream_error"}}\n')
    assert answer.error == "stream error: engine 127.0.0.1:9 died mid-stream"
