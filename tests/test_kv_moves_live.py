"""KV moves in the live gateway: a workflow submitted over HTTP to a real gateway in front of
four real simulated engines that run the NixlConnector two-leg flow. While the fan-out's parent
decodes, the planner copies its prompt to the engines its children are planned for; the children
then find it in those engines' local prefix caches. Everything is read from the engines' own
`/metrics` and the gateway's."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvgate.procs import Child, free_port, spawn, wait_healthy
from planner.profiles import get_profile
from tests.conftest import MODEL

SYSTEM = "You are a careful researcher who cites sources and checks every figure twice. " * 60
CONNECTOR = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
WORKERS = 4
SIM_BLOCK = get_profile("h100-llama3-8b").block_size
"""The simulated engines' KV block size (their default profile's)."""


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Child, list[Child]]]:
    logs = tmp_path_factory.mktemp("kv-moves-live")
    events = free_port()
    sims = []
    gateway = None
    try:
        for i in range(4):
            port = free_port()
            sim = spawn(f"sim-{i}", ["sim", "--host", "127.0.0.1", "--port", str(port),
                                     "--model", MODEL, "--seed", str(i),
                                     "--kv-events", f"tcp://127.0.0.1:{events}",
                                     "--kv-transfer-config", CONNECTOR, "--kv-link", "rdma",
                                     "--enable-prompt-tokens-details"],
                        f"http://127.0.0.1:{port}", logs)
            sims.append(sim)
        for sim in sims:
            wait_healthy(sim)
        port = free_port()
        config = {"host": "127.0.0.1", "port": port, "policy": "kvgate",
                  "kv_events_bind": f"tcp://127.0.0.1:{events}", "scrape_interval_s": 0.2,
                  "health_interval_s": 0.5, "kv_transfer": {"link": "rdma"},
                  "engines": [{"url": s.url} for s in sims]}
        path = logs / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        gateway = spawn("gateway", ["serve", "--config", str(path)],
                        f"http://127.0.0.1:{port}", logs)
        wait_healthy(gateway)
        yield gateway, sims
    finally:
        if gateway is not None:
            gateway.stop()
        for sim in sims:
            sim.stop()


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("model_name", "engine")))
            out[(s.name, labels)] = s.value
    return out


def by_source(url: str, source: str) -> float:
    return metrics(url).get(("vllm:prompt_tokens_by_source_total", (("source", source),)), 0.0)


def post(url: str, body: Any) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status, json.loads(r.read())


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def fanout(system: str = SYSTEM) -> dict[str, Any]:
    """plan -> WORKERS children that extend the plan's whole conversation."""
    head = [{"segment": "sys"}, {"role": "user", "content": "Plan the survey in steps."}]
    return {
        "model": MODEL,
        "segments": {"sys": {"kind": "static", "content": system}},
        "tasks": [
            {"id": "plan", "output_tokens": 48, "messages": head},
            *({"id": f"w{i}", "after": ["plan"], "output_tokens": 8,
               "messages": [*head, {"output_of": "plan"},
                            {"role": "user", "content": f"Now do step {i}."}]}
              for i in range(WORKERS)),
        ],
    }


def test_a_fanout_parent_is_copied_to_its_childrens_engines_over_the_two_legs(
        pool: tuple[Child, list[Child]]) -> None:
    gateway, sims = pool
    status, snap = post(f"{gateway.url}/v1/workflows", fanout())
    assert status == 201, snap
    deadline = time.monotonic() + 60
    while snap["state"] not in ("done", "failed", "cancelled"):
        assert time.monotonic() < deadline, (snap["tasks"], {
            k: v for k, v in metrics(gateway.url).items() if k[0].startswith("kvgate_kv")})
        time.sleep(0.1)
        snap = get(f"{gateway.url}/v1/workflows/{snap['id']}")
    assert snap["state"] == "done", snap
    engines = {t: rec["engine"] for t, rec in snap["tasks"].items()}
    # The workflow's status lists each move its tasks' prompts were the origin of.
    moves = snap["tasks"]["plan"].get("kv_moves", [])
    prefetched = [m for m in moves if m["reason"] == "prefetch" and m["outcome"] == "done"]
    assert prefetched, snap["tasks"]["plan"]
    assert all(m["kind"] == "transfer" and m["bytes"] > 0 and m["source"] != m["destination"]
               for m in prefetched)
    plan_engine = engines["plan"]
    gw = metrics(gateway.url)
    done = gw.get(("kvgate_kv_moves_total", (("kind", "transfer"), ("outcome", "done"),
                                             ("reason", "prefetch"))), 0.0)
    assert done >= 1, {k: v for k, v in gw.items() if k[0].startswith("kvgate_kv_move")}
    urls = {s.url: s for s in sims}
    # The copies landed before any child was sent to the engine they went to.
    landed = {m["destination"]: m["ended_s"] for m in prefetched}
    for i in range(WORKERS):
        child = snap["tasks"][f"w{i}"]
        if child["engine"] in landed:
            assert landed[child["engine"]] <= child["dispatched_s"], (child, prefetched)
    # Every copy's destination received the prompt by transfer (NIXL bytes, external tokens).
    for engine in landed:
        url = next(u for u in urls if engine in (u, u.removeprefix("http://")))
        assert by_source(url, "external_kv_transfer") > 0, engine
        assert metrics(url).get(("vllm:nixl_bytes_transferred_sum", ()), 0.0) > 0
    # Children placed off their parent's engine (the cost model decides; on this 8B profile
    # batching them with the parent is nearly free, so it may keep them all there) found the
    # prompt in their engine's local cache.
    child_engines = {engines[f"w{i}"] for i in range(WORKERS)} - {plan_engine}
    for engine in child_engines:
        url = next(u for u in urls if engine in (u, u.removeprefix("http://")))
        assert by_source(url, "local_cache_hit") > by_source(url, "local_compute"), engine
    plan_url = next(u for u in urls if plan_engine in (u, u.removeprefix("http://")))
    assert by_source(plan_url, "external_kv_transfer") == 0


def test_kv_moves_are_spans_under_their_origin_call_in_the_workflow_trace(
        pool: tuple[Child, list[Child]]) -> None:
    gateway, _ = pool
    # A prompt no engine holds yet (the other tests' prompts are cached by now).
    status, snap = post(f"{gateway.url}/v1/workflows", fanout("Traced. " + SYSTEM))
    assert status == 201, snap
    deadline = time.monotonic() + 60
    while snap["state"] == "running":
        assert time.monotonic() < deadline, snap["tasks"]
        time.sleep(0.1)
        snap = get(f"{gateway.url}/v1/workflows/{snap['id']}")
    assert snap["state"] == "done", snap
    spans = get(f"{gateway.url}/v1/workflows/{snap['id']}/trace")["spans"]
    assert {s["trace_id"] for s in spans} == {snap["trace_id"]}
    by_id = {s["span_id"]: s for s in spans}
    moves = [s for s in spans if s["name"] == "kv transfer"]
    recorded = {m["id"]: m for m in snap["tasks"]["plan"].get("kv_moves", [])}
    assert moves and {m["attributes"]["kvgate.move.id"] for m in moves} == set(recorded)
    for move in moves:
        a = move["attributes"]
        assert a["kvgate.move.outcome"] == recorded[a["kvgate.move.id"]]["outcome"]
        assert a["kvgate.move.source"] != a["kvgate.move.destination"]
        assert a["kvgate.move.bytes"] > 0 and a["kvgate.move.tokens"] > 0
        # The plan's call (the prompt copied) is its parent while the plan decodes.
        call = by_id[move["parent_span_id"]]
        assert call["name"] == f"chat {MODEL}"
        assert by_id[call["parent_span_id"]]["name"] == "task plan"


def post_status(url: str, body: Any) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_two_legs_answer_as_vllm_and_a_lost_lease_fails_the_consumer(
        pool: tuple[Child, list[Child]]) -> None:
    _, sims = pool
    a, b = sims[0].url, sims[1].url
    ids = [(7 * i) % 3000 + 10 for i in range(641)]
    status, first = post_status(f"{a}/v1/completions", {
        "model": MODEL, "prompt": ids, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, first
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    # One list of block ids per KV-cache group; the partial last block is exported too.
    (blocks,) = params["remote_block_ids"]
    assert len(blocks) == -(-641 // SIM_BLOCK)
    assert params["remote_num_tokens"] == len(ids) and params["transfer_mode"] == "pull"
    assert {"remote_engine_id", "remote_request_id", "remote_host", "remote_port",
            "tp_size"} <= set(params)
    before = by_source(b, "external_kv_transfer")
    status, second = post_status(f"{b}/v1/completions", {
        "model": MODEL, "prompt": ids, "max_tokens": 1, "kv_transfer_params": params})
    assert status == 200, second
    assert by_source(b, "external_kv_transfer") - before == len(ids)
    # The consumer reports the producer's own cache hit (none: the prompt was new there) as
    # its cached tokens, not the transfer's near-total one.
    assert params["remote_prefill_cached_tokens"] == first["usage"]["prompt_tokens_details"][
        "cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # The producer freed its blocks once read: the same params again find nothing to pull,
    # and under vLLM's default kv_load_failure_policy (fail) the request ends in an error.
    status, third = post_status(f"{sims[2].url}/v1/completions", {
        "model": MODEL, "prompt": ids, "max_tokens": 1, "kv_transfer_params": params})
    assert status == 500, third
    assert third["error"]["type"] == "InternalServerError"
    # Streamed, the error is an event, then [DONE]: vLLM sends no usage after it, even when
    # the client asked for usage.
    req = urllib.request.Request(f"{sims[3].url}/v1/completions", method="POST",
                                 data=json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 1,
                                                  "kv_transfer_params": params, "stream": True,
                                                  "stream_options": {"include_usage": True}
                                                  }).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = r.read().decode()
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["type"] == "InternalServerError", events
    assert events[-1] == "[DONE]" and '"usage"' not in text


def hold_blocks(url: str) -> threading.Thread:
    """A call in the background that holds 44 of a 60-block engine's blocks: a 600-token
    prompt decoding 100 more."""
    thread = threading.Thread(target=post_status, args=(f"{url}/v1/completions", {
        "model": MODEL, "prompt": list(range(20, 620)), "max_tokens": 100,
        "min_tokens": 100}))
    thread.start()
    return thread


def test_a_consumer_that_waits_keeps_its_producers_lease_and_one_that_leaves_frees_it(
        tmp_path: Path) -> None:
    """NixlConnector's heartbeats (every lease/6 by the consumer's own lease, each renewing two
    thirds of the producer's): the consumer request waits at B (its blocks are taken by a long
    decode) past the 2 s lease, and A still holds the export when B reads it; a consumer
    request whose client leaves before the read frees A's export at once."""
    events = free_port()
    short = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"kv_lease_duration": 2}})
    sims = []
    try:
        for name, extra in (("producer", ["--kv-transfer-config", short]),
                            ("consumer", ["--kv-transfer-config", short,
                                          "--kv-blocks", "60", "--time-scale", "5"])):
            port = free_port()
            sims.append(spawn(name, ["sim", "--host", "127.0.0.1", "--port", str(port),
                                     "--model", MODEL, "--kv-events",
                                     f"tcp://127.0.0.1:{events}", "--kv-link", "rdma", *extra],
                              f"http://127.0.0.1:{port}", tmp_path))
        for sim in sims:
            wait_healthy(sim)
        a, b = sims[0].url, sims[1].url
        ids = [(7 * i) % 3000 + 10 for i in range(641)]
        blocker = hold_blocks(b)
        # A keeps stepping meanwhile (an idle vLLM reaps no lease: it only does so in a step).
        busy = threading.Thread(target=post_status, args=(f"{a}/v1/completions", {
            "model": MODEL, "prompt": list(range(5, 105)), "max_tokens": 800,
            "min_tokens": 800}))
        busy.start()
        status, first = post_status(f"{a}/v1/completions", {
            "model": MODEL, "prompt": ids, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}})
        assert status == 200, first
        started = time.monotonic()
        status, second = post_status(f"{b}/v1/completions", {
            "model": MODEL, "prompt": ids, "max_tokens": 1,
            "kv_transfer_params": first["kv_transfer_params"]})
        waited = time.monotonic() - started
        blocker.join()
        busy.join()
        assert status == 200, second
        assert waited > 2.5  # past the lease
        produced = metrics(a)
        assert produced[("vllm:nixl_num_kv_expired_reqs_total", ())] == 0
        assert produced[("vllm:nixl_num_notifications_after_expiry_total", ())] == 0
        assert by_source(b, "external_kv_transfer") == len(ids)

        # A consumer that leaves before its read: the export is freed, not held for the lease.
        status, third = post_status(f"{a}/v1/completions", {
            "model": MODEL, "prompt": ids[::-1], "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}})
        assert status == 200, third
        assert metrics(a)[("vllm:kv_cache_usage_perc", ())] > 0
        blocker = hold_blocks(b)
        time.sleep(0.5)
        req = urllib.request.Request(f"{b}/v1/completions", method="POST", data=json.dumps({
            "model": MODEL, "prompt": ids[::-1], "max_tokens": 1,
            "kv_transfer_params": third["kv_transfer_params"]}).encode(),
            headers={"Content-Type": "application/json"})
        with pytest.raises(TimeoutError):
            urllib.request.urlopen(req, timeout=0.5)
        deadline = time.monotonic() + 1.5  # well inside the 2 s lease
        while metrics(a)[("vllm:kv_cache_usage_perc", ())] > 0:
            assert time.monotonic() < deadline, "the export was held after its consumer left"
            time.sleep(0.05)
        assert metrics(a)[("vllm:nixl_num_kv_expired_reqs_total", ())] == 0
        blocker.join()
    finally:
        for sim in sims:
            sim.stop()


def test_a_request_id_used_again_is_its_own_origin(pool: tuple[Child, list[Child]]) -> None:
    """A KV move copies a prompt found by its request's id, also a finished one's (a join's
    prefetch of its parent): a client's `x-request-id` used again is told apart, so a copy
    never takes another call's prompt."""
    gateway, _ = pool
    for i in range(2):
        req = urllib.request.Request(
            f"{gateway.url}/v1/chat/completions", method="POST",
            data=json.dumps({"model": MODEL, "max_tokens": 2, "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"question {i}"}]}).encode(),
            headers={"Content-Type": "application/json", "x-request-id": "reused-7"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
    traces = get(f"{gateway.url}/v1/traces?limit=50")["traces"]
    ids = []
    for t in traces:
        for sp in get(f"{gateway.url}/v1/traces/{t['trace_id']}")["spans"]:
            rid = sp["attributes"].get("kvgate.request.id", "")
            if sp["parent_span_id"] is None and rid.startswith("reused-7"):
                ids.append(rid)
    assert len(ids) == 2 and "reused-7" in ids and len(set(ids)) == 2, ids


def test_malformed_transfer_params_are_a_400_naming_the_field(
        pool: tuple[Child, list[Child]]) -> None:
    _, sims = pool
    status, body = post_status(f"{sims[0].url}/v1/completions", {
        "model": MODEL, "prompt": [11, 12, 13], "max_tokens": 1,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3]}})
    assert status == 400
    assert "remote_block_ids" in body["error"]["message"]


def test_live_bench_with_a_link_moves_kv_through_the_engines(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "bench", "--mode", "live", "--workload", "fanout",
         "--workload-arg", "context_tokens=3000", "--workload-arg", "width=4", "--engines", "3",
         "--workflows", "4", "--rate", "1", "--link", "rdma", "--policy", "kvgate,dynamo-like",
         "--no-progress", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["link"]["name"] == "rdma"
    kvgate, dynamo = report["results"]["kvgate"], report["results"]["dynamo-like"]
    assert kvgate["failed"] == 0 and dynamo["failed"] == 0
    assert kvgate["transferred_bytes"] > 0  # read from the engines' own NIXL counters
    assert dynamo["transferred_bytes"] == 0
