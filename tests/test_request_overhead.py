"""The profile's per-request server cost (`request_overhead_s`, `chat_overhead_s`): vLLM's API
server delays every request before its engine can schedule it, and the simulated engine, the
virtual driver and the lower bound all honour the fitted figures."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

from kvgate.bench.options import BenchOptions
from kvgate.bench.runner import run_bench
from kvgate.procs import start_sim

REQUEST_S, CHAT_S = 0.3, 0.4


def slow_server_profile(tmp_path: Path, request_s: float = REQUEST_S,
                        chat_s: float = CHAT_S) -> Path:
    path = tmp_path / "slow-server.yaml"
    path.write_text(yaml.safe_dump({"base": "cpu-tiny", "name": "slow-server",
                                    "request_overhead_s": request_s,
                                    "chat_overhead_s": chat_s}))
    return path


async def _ttft(url: str, path: str, body: dict[str, object]) -> float:
    start = time.perf_counter()
    async with aiohttp.ClientSession() as s, s.post(url + path, json={**body, "stream": True,
                                                                      "max_tokens": 2}) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            if raw.startswith(b"data:") and raw.strip() != b"data: [DONE]" \
                    and json.loads(raw[5:]).get("choices"):
                return time.perf_counter() - start
    raise AssertionError("no token came back")


async def _metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def test_the_sim_delays_a_request_by_the_server_cost_and_a_chat_by_more(tmp_path: Path) -> None:
    sim = start_sim("slow-server", tmp_path, ["--profile-file", str(slow_server_profile(
        tmp_path)), "--model", "m"])
    try:
        completion = asyncio.run(_ttft(sim.url, "/v1/completions",
                                       {"model": "m", "prompt": [5, 6, 7, 8]}))
        chat = asyncio.run(_ttft(sim.url, "/v1/chat/completions", {
            "model": "m", "messages": [{"role": "user", "content": "hello there"}]}))
    finally:
        sim.stop()
    assert REQUEST_S <= completion < REQUEST_S + CHAT_S
    assert chat >= REQUEST_S + CHAT_S


def test_a_client_gone_before_its_request_reaches_the_engine_leaves_nothing_behind(
        tmp_path: Path) -> None:
    sim = start_sim("slow-server", tmp_path, ["--profile-file", str(slow_server_profile(
        tmp_path, request_s=0.5, chat_s=0.0)), "--model", "m"])

    async def scenario() -> tuple[float, float, float]:
        async def hang_up() -> None:
            async with aiohttp.ClientSession() as s, s.post(
                    sim.url + "/v1/completions",
                    json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 50,
                          "stream": True}) as r:
                await r.content.readany()

        with pytest.raises(TimeoutError):
            await asyncio.wait_for(hang_up(), 0.1)
        await asyncio.sleep(0.8)  # past the moment it would have reached the engine
        queued = (await _metric(sim.url, "vllm:num_requests_running")
                  + await _metric(sim.url, "vllm:num_requests_waiting"))
        prompts = await _metric(sim.url, "vllm:prompt_tokens_total")
        return queued, prompts, await _ttft(sim.url, "/v1/completions",
                                            {"model": "m", "prompt": [9, 10]})

    try:
        queued, prompts, later = asyncio.run(scenario())
    finally:
        sim.stop()
    assert (queued, prompts) == (0, 0)
    assert later >= 0.5


def _bench(**kw: object) -> dict:
    kw = {"engines": 2, **kw}
    options = BenchOptions(progress=False, workload="fanout", workflows=3,
                           policies=["round-robin"], rate=1.0,
                           workload_args={"width": "2"}, **kw)  # type: ignore[arg-type]
    return run_bench(options, out=io.StringIO())


def test_virtual_runs_and_the_lower_bound_pay_the_server_cost_per_task(tmp_path: Path) -> None:
    quick = _bench(profile_file=str(slow_server_profile(tmp_path, 0.0, 0.0)))
    slow = _bench(profile_file=str(slow_server_profile(tmp_path)))
    # fanout is plan -> researchers -> reduce: three chat calls on the critical path.
    path = 3 * (REQUEST_S + CHAT_S)
    assert slow["lower_bound"]["jct_mean_s"] == pytest.approx(
        quick["lower_bound"]["jct_mean_s"] + path, rel=1e-9)
    assert slow["results"]["round-robin"]["ttft_p50_s"] >= REQUEST_S + CHAT_S
    assert slow["results"]["round-robin"]["jct_mean_s"] >= \
        quick["results"]["round-robin"]["jct_mean_s"] + path


def _server_profile(tmp_path: Path, per_token_s: float, servers: int) -> Path:
    path = tmp_path / f"server-{servers}.yaml"
    path.write_text(yaml.safe_dump({"base": "cpu-tiny", "name": f"server-{servers}",
                                    "request_overhead_s": 0.0, "chat_overhead_s": 0.0,
                                    "request_overhead_per_token_s": per_token_s,
                                    "api_servers": servers}))
    return path


PER_TOKEN_S = 2e-4
"""A server this slow per prompt token takes 0.2 s over a 1,000-token prompt."""


def test_the_sim_charges_each_prompt_token_and_queues_requests_at_its_api_server(
        tmp_path: Path) -> None:
    # One API server process: a request waits for the one before it to be handed over.
    sim = start_sim("one-server", tmp_path, ["--profile-file", str(_server_profile(
        tmp_path, PER_TOKEN_S, 1)), "--model", "m"])
    long = {"model": "m", "prompt": [5 + i % 50 for i in range(1000)]}

    async def scenario() -> tuple[float, list[float]]:
        alone = await _ttft(sim.url, "/v1/completions", long)
        both = await asyncio.gather(*(_ttft(sim.url, "/v1/completions", {**long, "seed": s})
                                      for s in (1, 2)))
        return alone, sorted(both)

    try:
        alone, (first, second) = asyncio.run(scenario())
    finally:
        sim.stop()
    assert alone >= 1000 * PER_TOKEN_S
    assert first >= 1000 * PER_TOKEN_S
    assert second >= 2 * 1000 * PER_TOKEN_S  # behind the first at the one server


def test_api_servers_take_requests_one_at_a_time_in_arrival_order() -> None:
    from adapters.sim.frontend import ApiServer
    from planner.profile_file import parse_profile

    def server(n: int) -> ApiServer:
        return ApiServer(parse_profile({"base": "h100-llama3-8b", "request_overhead_s": 0.01,
                                        "request_overhead_per_token_s": 1e-6,
                                        "api_servers": n}))

    one, two, latency = server(1), server(2), server(0)
    # 0.01 + 1e-6 * 10,000 = 0.02 s per request.
    assert [one.admitted_at(0.0, False, 10_000) for _ in range(3)] == pytest.approx(
        [0.02, 0.04, 0.06])
    assert [two.admitted_at(0.0, False, 10_000) for _ in range(3)] == pytest.approx(
        [0.02, 0.02, 0.04])
    assert [latency.admitted_at(0.0, False, 10_000) for _ in range(3)] == pytest.approx(
        [0.02] * 3)
    assert one.admitted_at(1.0, False, 0) == pytest.approx(1.01)  # idle again by then
    # A chat request adds the chat overhead; the simulated server's time scale scales it all.
    scaled = ApiServer(parse_profile({"base": "h100-llama3-8b", "request_overhead_s": 0.01,
                                      "chat_overhead_s": 0.03}), scale=0.5)
    assert scaled.admitted_at(0.0, True, 100) == pytest.approx(0.02)


def test_virtual_runs_and_the_bound_pay_the_server_per_prompt_token_and_queue_at_it(
        tmp_path: Path) -> None:
    free = _bench(profile_file=str(_server_profile(tmp_path, 0.0, 0)), engines=1)
    latency = _bench(profile_file=str(_server_profile(tmp_path, PER_TOKEN_S, 0)), engines=1)
    queued = _bench(profile_file=str(_server_profile(tmp_path, PER_TOKEN_S, 1)), engines=1)
    # Every prompt of fanout holds its static prefix (thousands of tokens): each call on the
    # critical path (plan, a researcher, the reduce) costs the server 0.2 s per 1,000.
    bound_free, bound = free["lower_bound"]["jct_mean_s"], latency["lower_bound"]["jct_mean_s"]
    assert bound >= bound_free + 3 * 1000 * PER_TOKEN_S
    # The bound never queues; the run with one server process does: the two researchers of a
    # workflow reach the one engine together, and the second waits for the first's hand-over.
    assert queued["lower_bound"]["jct_mean_s"] == pytest.approx(bound, rel=1e-9)
    assert queued["results"]["round-robin"]["jct_mean_s"] > \
        latency["results"]["round-robin"]["jct_mean_s"] + 1000 * PER_TOKEN_S / 3
