"""Tenants (gateway/tenants.py): with tenants configured every `/v1/` call needs a key, a
tenant's calls are cached under the gateway's salt for it (whatever the client sends), and a
tenant's workflows are its own; the admin key reads them all and makes no calls."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any
from unittest.mock import ANY

import openai
import pytest
from aiohttp import web

from gateway.config import ConfigError, parse_config
from gateway.tracing import trace_hex, workflow_trace_id
from kvgate.procs import Child, wait_healthy
from tests.conftest import MODEL, ThreadedServer
from tests.test_gateway_failures import RecordingEngine
from tests.test_workflow_api import call

ADMIN = "admin-" + "a" * 26
ACME, ACME_LABS, BETA = "sk-acme-" + "1" * 24, "sk-labs-" + "2" * 24, "sk-beta-" + "3" * 24
TENANTS = {"acme": {"keys": [ACME], "prefix_group": "acme"},
           "acme-labs": {"keys": [ACME_LABS], "prefix_group": "acme"},
           "beta": {"keys": [BETA]}}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def spec(wf_id: str) -> dict[str, Any]:
    return {"id": wf_id, "model": MODEL, "tasks": [
        {"id": "t", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}]}


@pytest.fixture
def recorded(threaded_server: Callable[[web.Application], ThreadedServer],
             spawn_gateway: Callable[[dict[str, Any]], Child]) -> tuple[RecordingEngine, Child]:
    engine = RecordingEngine()
    engine.release.set()
    server = threaded_server(engine.app)
    gw = spawn_gateway({"engines": [{"url": server.url}], "tenants": TENANTS,
                        "admin_key": ADMIN})
    wait_healthy(gw)
    return engine, gw


@pytest.fixture
def served(spawn_sim: Callable[..., Child],
           spawn_gateway: Callable[[dict[str, Any]], Child]) -> Child:
    sim = spawn_sim()
    gw = spawn_gateway({"engines": [{"url": sim.url}], "tenants": TENANTS, "admin_key": ADMIN})
    wait_healthy(gw)
    return gw


def chat(gw: Child, key: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, _, answer = call("POST", f"{gw.url}/v1/chat/completions",
                             {"model": "rec", "messages": [], "stream": True, **body},
                             headers=auth(key)) if key else call(
        "POST", f"{gw.url}/v1/chat/completions", {"model": "rec", "messages": []})
    return status, answer


def test_every_call_needs_a_tenants_key(recorded: tuple[RecordingEngine, Child]) -> None:
    _, gw = recorded
    status, answer = chat(gw, "", {})
    assert status == 401 and "Authorization: Bearer KEY" in answer["error"]["message"]
    status, answer = chat(gw, "sk-nobody-" + "9" * 20, {})
    assert status == 401 and "not one of this gateway's" in answer["error"]["message"]
    status, answer = chat(gw, ADMIN, {})
    assert status == 403 and "calls need a tenant's key" in answer["error"]["message"]
    status, _, models = call("GET", f"{gw.url}/v1/models")
    assert status == 401
    status, _, models = call("GET", f"{gw.url}/v1/models", headers=auth(BETA))
    assert status == 200 and [m["id"] for m in models["data"]] == ["rec"]
    # A liveness probe needs no key (the k8s manifest's).
    assert call("GET", f"{gw.url}/livez") == (200, ANY, {"status": "alive"})


def test_a_tenants_calls_carry_the_gateways_salt_for_it(
        recorded: tuple[RecordingEngine, Child]) -> None:
    engine, gw = recorded
    salts = {}
    for key in (ACME, ACME_LABS, BETA):
        # A client's own salt (here another tenant's) does not choose its cache.
        urllib.request.urlopen(urllib.request.Request(
            f"{gw.url}/v1/chat/completions", method="POST",
            data=json.dumps({"model": "rec", "messages": [], "stream": True,
                             "cache_salt": "kvgate-tenant:beta"}).encode(),
            headers={"Content-Type": "application/json", **auth(key)}), timeout=30).read()
        salts[key] = json.loads(engine.requests[-1][1])["cache_salt"]
    # One prefix group shares a salt; another tenant has its own.
    assert salts[ACME] == salts[ACME_LABS] == "kvgate-tenant:acme"
    assert salts[BETA] == "kvgate-tenant:beta"


def test_a_tenants_call_may_not_drive_kv_transfers(
        recorded: tuple[RecordingEngine, Child]) -> None:
    # A consumer leg names another engine's blocks and the host its NIXL read goes to; a
    # producer leg pins blocks and answers with the engine's address.
    engine, gw = recorded
    sent = len(engine.requests)
    for params in ({"do_remote_decode": True},
                   {"do_remote_prefill": True, "remote_block_ids": [[0, 1, 2]],
                    "remote_host": "127.0.0.1", "remote_port": 9}):
        status, answer = chat(gw, BETA, {"kv_transfer_params": params})
        assert status == 400, answer
        assert answer["error"]["param"] == "kv_transfer_params"
        assert "gateway's to set" in answer["error"]["message"]
    assert len(engine.requests) == sent
    status, _, answer = call("POST", f"{gw.url}/v1/workflows", {
        **spec("wf-nixl"), "tasks": [{**spec("x")["tasks"][0],
                                      "params": {"kv_transfer_params": {}}}]},
        headers=auth(BETA))
    assert status == 400 and "params may not set kv_transfer_params" in str(answer)


def test_a_tenants_workflows_are_its_own(served: Child) -> None:
    gw = served
    url = f"{gw.url}/v1/workflows"
    status, _, snap = call("POST", url, {**spec("mine"), "tenant": "beta"}, headers=auth(ACME))
    assert status == 400 and "set by your key" in snap["error"]["message"]
    status, _, snap = call("POST", url, spec("mine"), headers=auth(ACME))
    assert status == 201 and snap["tenant"] == "acme"
    wf = snap["id"]
    for method, path in (("GET", f"/{wf}"), ("GET", f"/{wf}/events"), ("DELETE", f"/{wf}")):
        status, _, answer = call(method, url + path, headers=auth(BETA))
        assert status == 404, (method, path, answer)
    # Not even a tenant sharing acme's prefixes reads it.
    assert call("GET", f"{url}/{wf}", headers=auth(ACME_LABS))[0] == 404
    assert [w["id"] for w in call("GET", url, headers=auth(BETA))[2]["data"]] == []
    assert [w["id"] for w in call("GET", url, headers=auth(ACME))[2]["data"]] == [wf]
    deadline = time.monotonic() + 30
    while call("GET", f"{url}/{wf}", headers=auth(ACME))[2]["state"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # Its task's call went through the gateway under the submitter's key.
    assert call("GET", f"{url}/{wf}", headers=auth(ACME))[2]["state"] == "done"
    # The operator reads every tenant's, and submits none.
    assert call("GET", f"{url}/{wf}", headers=auth(ADMIN))[0] == 200
    assert [w["id"] for w in call("GET", url, headers=auth(ADMIN))[2]["data"]] == [wf]
    assert call("POST", url, spec("ops"), headers=auth(ADMIN))[0] == 403


def test_hint_mode_calls_join_only_their_tenants_workflows(served: Child) -> None:
    gw = served

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)

    def ask(key: str, task: str) -> None:
        client(key).chat.completions.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-KVGate-Workflow": "agent-1", "X-KVGate-Task": task})

    ask(ACME, "plan")
    with pytest.raises(openai.NotFoundError, match="no workflow 'agent-1' of yours"):
        ask(BETA, "intrude")
    ask(ACME, "act")
    status, _, snap = call("GET", f"{gw.url}/v1/workflows/agent-1", headers=auth(ACME))
    assert status == 200 and snap["tenant"] == "acme"
    assert sorted(snap["tasks"]) == ["act", "plan"]


def test_traces_are_the_operators_but_a_workflows_own_is_its_tenants(served: Child) -> None:
    gw = served
    assert call("GET", f"{gw.url}/v1/traces", headers=auth(ACME))[0] == 403
    assert call("GET", f"{gw.url}/v1/traces", headers=auth(ADMIN))[0] == 200
    status, _, snap = call("POST", f"{gw.url}/v1/workflows", spec("traced"), headers=auth(ACME))
    assert status == 201
    trace = f"{gw.url}/v1/workflows/{snap['id']}/trace"
    deadline = time.monotonic() + 30
    while call("GET", trace, headers=auth(ACME))[0] != 200:  # spans appear as they end
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert call("GET", trace, headers=auth(BETA))[0] == 404
    assert call("GET", trace, headers=auth(ADMIN))[0] == 200
    # A hint-mode id may hold `/`: its trace, asked with the id encoded, is still its own.
    openai.OpenAI(base_url=f"{gw.url}/v1", api_key=ACME, max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
        extra_headers={"X-KVGate-Workflow": "team/agent", "X-KVGate-Task": "t"})
    slashed = f"{gw.url}/v1/workflows/team%2Fagent/trace"
    deadline = time.monotonic() + 30
    while call("GET", slashed, headers=auth(ACME))[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert call("GET", slashed, headers=auth(BETA))[0] == 404


def test_a_tenant_cannot_read_anothers_spans_by_joining_its_trace(served: Child) -> None:
    """A client may choose its trace (`traceparent`), and a hint-mode workflow's trace id is
    derived from its id: another tenant's workflow submitted into that trace reads its own
    spans only, and the owner still reads all of its own."""
    gw = served
    openai.OpenAI(base_url=f"{gw.url}/v1", api_key=ACME, max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "secret plan"}],
        extra_headers={"X-KVGate-Workflow": "agent-42", "X-KVGate-Task": "plan"})
    parent = f"00-{trace_hex(workflow_trace_id('agent-42'))}-{'1' * 16}-01"
    status, _, snap = call("POST", f"{gw.url}/v1/workflows", spec("intruder"),
                           headers={**auth(BETA), "traceparent": parent})
    assert status == 201 and snap["trace_id"] == trace_hex(workflow_trace_id("agent-42"))
    intruder = snap["id"]

    def spans(wf: str, key: str, needed: str) -> list[dict[str, Any]]:
        deadline = time.monotonic() + 30
        while True:  # spans appear as they end
            status, _, doc = call("GET", f"{gw.url}/v1/workflows/{wf}/trace", headers=auth(key))
            if status == 200 and needed in [s["name"] for s in doc["spans"]]:
                return list(doc["spans"])
            assert time.monotonic() < deadline, (status, doc)
            time.sleep(0.1)

    theirs = spans(intruder, BETA, f"workflow {intruder}")
    assert "task plan" not in [s["name"] for s in theirs]
    assert all(s["attributes"].get("kvgate.workflow.id") in (None, intruder) for s in theirs)
    mine = spans("agent-42", ACME, "task plan")
    assert "task plan" in [s["name"] for s in mine]
    assert all(s["attributes"].get("kvgate.workflow.id") in (None, "agent-42") for s in mine)


@pytest.fixture
def expiring(spawn_sim: Callable[..., Child],
             spawn_gateway: Callable[[dict[str, Any]], Child]) -> Child:
    """A gateway with tenants whose workflow records expire 1.5 s after their last write."""
    sim = spawn_sim()
    gw = spawn_gateway({"engines": [{"url": sim.url}], "tenants": TENANTS, "admin_key": ADMIN,
                        "workflows": {"ttl_s": 1.5}})
    wait_healthy(gw)
    return gw


def hint_call(gw: Child, key: str, workflow: str, task: str) -> None:
    """One hint-mode call of `workflow`'s `task`, as the tenant of `key`."""
    openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": f"{task} notes"}],
        extra_headers={"X-KVGate-Workflow": workflow, "X-KVGate-Task": task})


def wait_expired(gw: Child, workflow: str) -> None:
    """Until the workflow's record has expired (its id is free again)."""
    deadline = time.monotonic() + 30
    while call("GET", f"{gw.url}/v1/workflows/{workflow}", headers=auth(ADMIN))[0] != 404:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_hint_mode_id_used_again_after_it_expired_shows_only_the_new_owners_spans(
        expiring: Child) -> None:
    gw = expiring

    def ask(key: str, task: str) -> None:
        hint_call(gw, key, "reused-7", task)

    def names(key: str, needed: str) -> list[str]:
        deadline = time.monotonic() + 30
        while True:  # spans appear as they end
            status, _, doc = call("GET", f"{gw.url}/v1/workflows/reused-7/trace",
                                  headers=auth(key))
            if status == 200 and needed in (got := [s["name"] for s in doc["spans"]]):
                return got
            assert time.monotonic() < deadline, (status, doc)
            time.sleep(0.1)

    ask(ACME, "acme-secret")
    assert "task acme-secret" in names(ACME, "task acme-secret")
    wait_expired(gw, "reused-7")
    ask(BETA, "beta-task")
    theirs = names(BETA, "task beta-task")
    assert "task acme-secret" not in theirs
    assert "task acme-secret" in names(ADMIN, "task beta-task")  # the operator reads all


def test_an_event_stream_ends_when_its_hint_mode_id_passes_to_another_tenant(
        expiring: Child) -> None:
    """A stream opened on a workflow follows that workflow only: once its record expires and
    another tenant's calls take the id, the stream ends (it went on with the new owner's
    events, their outputs included)."""
    gw = expiring

    def ask(key: str, task: str) -> None:
        hint_call(gw, key, "passed-on", task)

    ask(ACME, "acme-task")
    seen: list[str] = []
    opened = threading.Event()

    def follow() -> None:
        host, port = gw.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("GET", "/v1/workflows/passed-on/events", headers=auth(ACME))
        resp = conn.getresponse()
        assert resp.status == 200
        opened.set()
        while line := resp.readline():
            if line.startswith(b"data:"):
                seen.append(json.loads(line[5:]).get("task", ""))

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    assert opened.wait(30)
    wait_expired(gw, "passed-on")
    n, deadline = 0, time.monotonic() + 40
    while reader.is_alive() and time.monotonic() < deadline:
        ask(BETA, f"beta-task-{n}")  # until the stream has waited out its quiet interval
        n += 1
        time.sleep(0.5)
    status, _, doc = call("GET", f"{gw.url}/v1/workflows/passed-on", headers=auth(BETA))
    assert status == 200 and doc["tenant"] == "beta"
    assert not reader.is_alive()  # the stream ended
    assert "acme-task" in seen
    assert not [t for t in seen if t.startswith("beta")]


@pytest.mark.parametrize("tenants, message", [
    ({"acme": {"keys": ["short"]}}, "at least 16"),
    ({"acme": {"keys": [ACME]}, "beta": {"keys": [ACME]}}, "listed twice"),
    ({"a b": {"keys": [ACME]}}, "tenant name 'a b'"),
    # vLLM refuses a cache_salt with a `/` in it: every call of the tenant would be a 400.
    ({"acme": {"keys": [ACME], "prefix_group": "team/a"}}, "prefix_group 'team/a'"),
    ({"acme": {"keys": [ADMIN]}}, "admin key may not also be a tenant's key"),
])
def test_a_tenant_config_that_would_mix_tenants_is_refused(tenants: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"engines": [{"url": "http://127.0.0.1:9"}], "tenants": tenants,
                      "admin_key": ADMIN})


@pytest.mark.parametrize("key", ["replace-with-a-long-random-key", "short-key",
                                 "a-secret-key-0123456789\n"])
def test_an_admin_key_anyone_could_know_is_refused(key: str) -> None:
    with pytest.raises(ConfigError, match="admin_key"):
        parse_config({"engines": [{"url": "http://127.0.0.1:9"}], "admin_key": key})


class KeyedEngine(RecordingEngine):
    """An engine run with vLLM's --api-key: its /v1/models answers only with the key."""

    async def models(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer engine-key-0123456789":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await super().models(request)


def test_a_tenants_key_stays_with_the_gateway_and_engines_get_theirs(
        threaded_server: Callable[[web.Application], ThreadedServer],
        spawn_gateway: Callable[[dict[str, Any]], Child]) -> None:
    for engine_key in (None, "engine-key-0123456789"):
        engine = KeyedEngine() if engine_key else RecordingEngine()
        engine.release.set()
        server = threaded_server(engine.app)
        config: dict[str, Any] = {"engines": [{"url": server.url}], "tenants": TENANTS}
        if engine_key:
            config["engine_api_key"] = engine_key
        gw = spawn_gateway(config)
        wait_healthy(gw)  # with the key, the engine's /v1/models answered the gateway
        urllib.request.urlopen(urllib.request.Request(
            f"{gw.url}/v1/chat/completions", method="POST",
            data=json.dumps({"model": "rec", "messages": [], "stream": True}).encode(),
            headers={"Content-Type": "application/json", **auth(ACME)}), timeout=30).read()
        sent = engine.requests[-1][0].get("Authorization")
        assert sent == (f"Bearer {engine_key}" if engine_key else None)


def test_with_tenants_a_call_naming_a_workflow_needs_the_store_to_say_whose_it_is(
    spawn_sim: Callable[..., Child], spawn_gateway: Callable[[dict[str, Any]], Child],
) -> None:
    from tests.redis_server import RedisServer

    sim = spawn_sim()
    with RedisServer() as url:
        gw = spawn_gateway({"engines": [{"url": sim.url}], "tenants": TENANTS,
                            "workflows": {"store": "redis", "redis_url": url}})
        wait_healthy(gw)
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=BETA, max_retries=0)
    with pytest.raises(openai.InternalServerError, match="could not be read"):
        client.chat.completions.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-KVGate-Workflow": "someones", "X-KVGate-Task": "t"})
    # A call naming no workflow needs no store.
    answer = client.chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content is not None



VIP, BATCH = "sk-vip-" + "4" * 25, "sk-batch-" + "5" * 23


@pytest.mark.parametrize("policy,scheduling", [("kvgate", "priority"),
                                               ("round-robin", "priority"),
                                               ("round-robin", "fcfs")])
def test_a_tenant_ranks_its_calls_no_higher_than_it_may(
        policy: str, scheduling: str, threaded_server: Callable[[web.Application], ThreadedServer],
        spawn_gateway: Callable[[dict[str, Any]], Child]) -> None:
    from tests.test_kv_moves_live import metrics

    # kvgate's planner sends a priority-scheduled engine its own rank, an explicit priority
    # a million per unit above everything else; a per-request router passes the client's
    # own body `priority` on. Either way a tenant used to put its calls ahead of everyone's.
    engine = RecordingEngine()
    engine.release.set()
    gw = spawn_gateway({"engines": [{"url": threaded_server(engine.app).url,
                                     "scheduling_policy": scheduling}],
                        "policy": policy, "admin_key": ADMIN, "tenants": {
                            **TENANTS, "vip": {"keys": [VIP], "priority_floor": -10},
                            "batch": {"keys": [BATCH], "priority_floor": 3}}})
    wait_healthy(gw)

    def sent_priority(key: str, asked: int | None) -> int:
        hint = ({} if asked is None else {"kvgate": {"priority": asked}} if policy == "kvgate"
                else {"priority": asked})
        urllib.request.urlopen(urllib.request.Request(
            f"{gw.url}/v1/chat/completions", method="POST",
            data=json.dumps({"model": "rec", "messages": [], "stream": True, **hint}).encode(),
            headers={"Content-Type": "application/json", **auth(key)}), timeout=30).read()
        return int(json.loads(engine.requests[-1][1]).get("priority", 0))

    if scheduling == "fcfs":
        # vLLM refuses any priority but 0 without priority scheduling: none is added.
        assert sent_priority(BATCH, None) == 0 and sent_priority(BETA, -5) == 0
        return
    if policy == "kvgate":
        from planner.priorities import EXPLICIT_UNIT as UNIT

        assert sent_priority(BETA, 0) >= 0
        assert sent_priority(BETA, -5) >= 0  # raised to its floor, 0
        assert sent_priority(VIP, -5) < -4 * UNIT  # within its floor
        assert -11 * UNIT < sent_priority(VIP, -50) < -9 * UNIT
        assert sent_priority(BETA, 3) > 2 * UNIT  # behind others: always allowed
        assert sent_priority(BATCH, None) > 2 * UNIT  # held behind, unasked
    else:
        assert sent_priority(BETA, -5) == 0
        # vLLM's lax integer field reads these as -1,000,000 (and True as 1): so does the clamp.
        for sneaky in ("-1000000", -1000000.0, " -7 "):
            assert sent_priority(BETA, sneaky) == 0  # type: ignore[arg-type]
        assert sent_priority(BATCH, True) == 3  # type: ignore[arg-type]
        assert sent_priority(BATCH, "0") == 3  # type: ignore[arg-type]
        assert sent_priority(VIP, -5) == -5
        assert sent_priority(VIP, -50) == -10
        assert sent_priority(BETA, 3) == 3
        assert sent_priority(BATCH, None) == 3
    hint = "priority" if policy == "kvgate" else "body priority"
    counted = metrics(gw.url)
    assert counted[("kvgate_hints_clamped_total", (("hint", hint), ("tenant", "beta")))] == (
        1 if policy == "kvgate" else 4)
    assert counted[("kvgate_hints_clamped_total", (("hint", hint), ("tenant", "vip")))] == 1


def test_a_tenants_deadline_ranks_only_as_far_as_configured() -> None:
    from gateway.tenants import Tenancy
    from planner.hints import RequestHints

    config = parse_config({"engines": [{"url": "http://127.0.0.1:9"}], "tenants": {
        **TENANTS, "vip": {"keys": [VIP], "min_deadline_s": 2.5}}})
    tenancy = Tenancy(config.tenants, None)
    beta, vip = (tenancy.resolve(auth(key)) for key in (BETA, VIP))
    hints = RequestHints(workflow="w", priority=1, deadline_s=0.001)
    assert beta.clamp(hints) == (RequestHints(workflow="w", priority=1), ["deadline_s"])
    assert vip.clamp(hints) == (RequestHints(workflow="w", priority=1, deadline_s=2.5),
                                ["deadline_s"])
    assert vip.clamp(RequestHints(deadline_s=9.0)) == (RequestHints(deadline_s=9.0), [])
    batch = Tenancy(parse_config({"engines": [{"url": "http://127.0.0.1:9"}], "tenants": {
        "batch": {"keys": [BATCH], "priority_floor": 3}}}).tenants, None).resolve(auth(BATCH))
    assert batch.clamp(RequestHints(deadline_s=1.0)) == (RequestHints(priority=3), ["deadline_s"])
    assert batch.clamp(RequestHints(priority=7)) == (RequestHints(priority=7), [])
    with pytest.raises(ConfigError, match="min_deadline_s"):
        parse_config({"engines": [{"url": "http://127.0.0.1:9"}], "tenants": {
            "vip": {"keys": [VIP], "min_deadline_s": 0}}})
