"""Live mode: the same workload over HTTP against real processes in real time.

Per policy: fresh `kvgate sim` engines, then either a `kvgate serve` gateway with that policy
(engines publish KV events to it over ZMQ) or, for `sglang-router`, the real sglang-router
package in front of the same kind of engines. With `--engine-urls` or `--engine-config` the
engines are ones already up (real vLLM, say): each policy gets a fresh front end, and the
engines' prefix caches are reset between policies (vLLM's `POST /reset_prefix_cache`). The
client replays every workflow, streaming each request and feeding real outputs into the prompts
that use them. Simulated step times are
multiplied by the time scale; the report converts real seconds back to model seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from adapters.vllm.dev import reset_done
from adapters.vllm.http import engine_connector
from kvgate.bench.options import BenchOptions, Prepared, progress_bar
from kvgate.bench.prompts import ChatMessage
from kvgate.bench.virtual import MODEL, RequestRecord, RunResult, WorkflowRecord
from kvgate.bench.workloads import BenchTask, BenchWorkflow, OutputRef, WorkloadError
from kvgate.benchmarks.placement import engine_counters, engine_metric
from kvgate.procs import (
    Child,
    StartupError,
    free_port,
    spawn,
    start_gateway,
    start_sim,
    wait_healthy,
)
from planner.core import planner_settings
from planner.dag import DagNode, DagRun, Wakeup

SGLANG_ROUTER = "sglang-router"


def default_time_scale(profile: str) -> float:
    """cpu-tiny runs in real time; GPU profiles ten times faster than the GPU would."""
    return 1.0 if profile == "cpu-tiny" else 0.1


def start_sglang_router(engine_urls: list[str], log_dir: Path) -> Child:
    """The real sglang-router (cache_aware, its defaults) in front of `engine_urls`."""
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise WorkloadError("policy sglang-router needs the sglang-router package: "
                            "pip install 'kvgate[bench]'") from None
    port, metrics_port = free_port(), free_port()
    log_path = log_dir / "sglang-router.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
             "--port", str(port), "--worker-urls", *engine_urls, "--policy", "cache_aware",
             "--prometheus-port", str(metrics_port), "--prometheus-host", "127.0.0.1",
             "--log-level", "warn"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    child = Child("sglang-router", f"http://127.0.0.1:{port}", proc, log_path)
    wait_healthy(child, timeout=60.0, path="/health")
    _wait_router_workers(child, len(engine_urls))
    return child


def _wait_router_workers(child: Child, expected: int, timeout: float = 60.0) -> None:
    """The router registers workers in the background: wait until it routes to all of them."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(f"{child.url}/workers", timeout=2) as r:
                data = json.load(r)
            workers = data.get("workers", data) if isinstance(data, dict) else data
            healthy = [w for w in workers if isinstance(w, dict) and w.get("is_healthy", True)]
            if len(healthy) >= expected:
                return
        time.sleep(0.2)
    raise StartupError(f"sglang-router did not register {expected} workers:\n{child.log_tail()}")


class LiveClient:
    """Replays workflows against one endpoint and records what it saw."""

    def __init__(self, url: str, prepared: Prepared, scale: float, policy: str,
                 progress: bool, model: str = MODEL) -> None:
        self.url = url
        self.model = model
        self.prepared = prepared
        self.scale = scale
        self.records: list[RequestRecord] = []
        self.workflows: dict[str, WorkflowRecord] = {}
        self.t0 = 0.0
        self._done = 0
        self._progress = progress_bar(policy) if progress else None

    def now(self) -> float:
        """Model seconds since the run started."""
        return (time.monotonic() - self.t0) / self.scale

    async def run(self) -> None:
        """Every workflow, by arrival times or as a closed loop."""
        p = self.prepared
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)
        connector = engine_connector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            self.t0 = time.monotonic()
            if p.load.arrivals is not None:
                arrivals = p.load.arrivals
                await asyncio.gather(*(self._at(session, wf, arrivals[wf.id])
                                       for wf in p.workflows))
            else:
                queue = list(p.workflows)

                async def lane() -> None:
                    while queue:
                        await self._workflow(session, queue.pop(0))

                await asyncio.gather(*(lane() for _ in range(p.load.concurrency or 1)))

    async def _at(self, session: aiohttp.ClientSession, wf: BenchWorkflow, t: float) -> None:
        await asyncio.sleep(max(0.0, t * self.scale - (time.monotonic() - self.t0)))
        await self._workflow(session, wf)

    async def _workflow(self, session: aiohttp.ClientSession, wf: BenchWorkflow) -> None:
        rec = WorkflowRecord(wf.id, self.now())
        self.workflows[wf.id] = rec
        outputs: dict[str, str] = {}
        # The DAG runtime decides readiness; this only sleeps until each wakeup (model
        # seconds x scale) and sends the request.
        run = DagRun(wf.id, [DagNode(t.id, t.after, t.think_time_s) for t in wf.tasks])

        async def run_task(wakeup: Wakeup) -> list[Wakeup]:
            await asyncio.sleep(max(0.0, (wakeup.at - self.now()) * self.scale))
            task = wf.task(wakeup.task)
            run.wake(task.id, self.now())
            run.dispatched(task.id, self.now())
            text = await self._request(session, wf, task, outputs)
            if text is None:
                run.fail(task.id, self.now(), "request failed")
                return []
            outputs[task.id] = text
            return run.finished(task.id, self.now(), text)

        pending = {asyncio.create_task(run_task(w)) for w in run.start(self.now())}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for finished in done:
                pending |= {asyncio.create_task(run_task(w)) for w in finished.result()}
        failed = run.failed
        rec.failed = bool(failed)
        rec.finished_s = self.now()
        self._done += 1
        if self._progress is not None:
            self._progress(self._done, len(self.prepared.workflows))

    def _body(self, wf: BenchWorkflow, task: BenchTask,
              outputs: dict[str, str]) -> tuple[str, dict[str, Any]]:
        common: dict[str, Any] = {
            "model": self.model, "max_tokens": task.output_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "user": wf.id,
            **task.params}
        if wf.tenant:
            common["cache_salt"] = wf.tenant
        if task.blocks:
            return "/v1/completions", {**common, "prompt": "".join(p.text for p in task.blocks)}
        messages = []
        for m in task.messages:
            if isinstance(m, OutputRef):
                messages.append({"role": m.role, "content": outputs[m.task]})
            elif isinstance(m, ChatMessage):
                messages.append({"role": m.role, "content": m.content.text})
        body = {**common, "messages": messages}
        if task.tools:
            body["tools"] = task.tools
        return "/v1/chat/completions", body

    async def _request(self, session: aiohttp.ClientSession, wf: BenchWorkflow,
                       task: BenchTask, outputs: dict[str, str]) -> str | None:
        route, body = self._body(wf, task, outputs)
        r = RequestRecord(wf.id, task.id, self.now())
        r.dispatched_s = r.ready_s
        self.records.append(r)
        pieces: list[str] = []
        try:
            async with session.post(f"{self.url}{route}", json=body,
                                    headers=dag_headers(wf, task)) as resp:
                r.engine = resp.headers.get("x-kvgate-engine", "")
                if resp.status != 200:
                    r.failed = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return None
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        r.failed = str(chunk["error"])[:300]
                        return None
                    for choice in chunk.get("choices") or []:
                        piece = choice.get("text")
                        if piece is None:
                            piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            if r.first_token_s is None:
                                r.first_token_s = self.now()
                            pieces.append(piece)
                    usage = chunk.get("usage")
                    if usage:
                        r.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        r.output_tokens = int(usage.get("completion_tokens") or 0)
                        details = usage.get("prompt_tokens_details") or {}
                        r.cached_tokens = int(details.get("cached_tokens") or 0)
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            r.failed = f"{type(e).__name__}: {e}"
            return None
        r.finished_s = self.now()
        if r.first_token_s is None:
            r.first_token_s = r.finished_s
        return "".join(pieces)


NIXL_CONFIG = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
"""vLLM's `--kv-transfer-config` for engines that move KV (VLLM_FACTS.md §7)."""


def existing_engines(o: BenchOptions) -> list[str]:
    """The URLs of the engines `--engine-urls` or `--engine-config` name (none: fresh sims)."""
    if o.engine_urls is not None:
        return [u.rstrip("/") for u in o.engine_urls]
    if o.engine_config is None:
        return []
    from gateway.config import ConfigError, load_config

    try:
        config = load_config(o.engine_config)
    except ConfigError as e:
        raise WorkloadError(f"--engine-config: {e}") from None
    return [e.url.rstrip("/") for e in config.engines]


def served_model(url: str) -> str:
    """The first model an engine serves (its `/v1/models`)."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
            doc = json.loads(r.read())
        return str(doc["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise WorkloadError(f"engine {url} did not list its models on /v1/models ({e}); is "
                            f"it up?") from None


def reset_prefix_caches(urls: list[str], timeout_s: float = 60.0) -> None:
    """Empty every engine's prefix cache, so a policy finds them as cold as the one before it
    did. vLLM answers `POST /reset_prefix_cache` only with VLLM_SERVER_DEV_MODE=1 (`kvgate
    vllm-pool` sets it), and answers `{"success": false}` while requests still hold blocks
    (retried)."""
    for url in urls:
        deadline = time.monotonic() + timeout_s
        while True:
            req = urllib.request.Request(f"{url}/reset_prefix_cache", data=b"", method="POST")
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    status, done = r.status, reset_done(r.read())
            except urllib.error.HTTPError as e:
                status, done = e.code, False
            except OSError as e:
                raise WorkloadError(f"engine {url} is unreachable: {e}") from None
            if done:
                break
            if status in (404, 405):
                raise WorkloadError(
                    f"engine {url} has no POST /reset_prefix_cache, so a policy would find the "
                    f"caches its predecessor warmed: start vLLM with VLLM_SERVER_DEV_MODE=1 "
                    f"(kvgate vllm-pool does), or bench one policy per run")
            if time.monotonic() > deadline:
                raise WorkloadError(f"engine {url} kept refusing to reset its prefix cache "
                                    f"(HTTP {status}, no success) for {timeout_s:.0f} s: is "
                                    f"other traffic running on it?")
            time.sleep(0.5)


def run_policy(o: BenchOptions, prepared: Prepared, policy: str, log_dir: Path,
               scale: float) -> RunResult:
    """Fresh engines (or the ones already up, their caches reset) and a fresh front end for
    `policy`, the whole workload, then the engines' counters."""
    children: list[Child] = []
    try:
        urls = existing_engines(o)
        model = MODEL
        if urls:
            reset_prefix_caches(urls)
            model = served_model(urls[0])
            if policy == SGLANG_ROUTER:
                front = start_sglang_router(urls, log_dir)
            elif o.engine_config is not None:
                port = free_port()
                front = spawn(f"{policy}-gateway", [
                    "serve", "--config", o.engine_config, "--policy", policy, "--host",
                    "127.0.0.1", "--port", str(port)], f"http://127.0.0.1:{port}", log_dir)
                wait_healthy(front)
            else:
                extra = ["--policy", policy]
                if o.transfer_link().enabled:
                    extra += ["--kv-link", o.link]
                front = start_gateway(urls, log_dir, extra, name=f"{policy}-gateway")
        else:
            events = f"tcp://127.0.0.1:{free_port()}"
            profile_args = ["--profile-file", o.profile_file] if o.profile_file else [
                "--profile", o.profile]
            sim_args = [*profile_args, "--model", MODEL, "--seed", str(o.seed),
                        "--time-scale", str(scale), "--enable-prompt-tokens-details"]
            if policy != SGLANG_ROUTER:
                sim_args += ["--kv-events", events]
            gateway_args = ["--policy", policy, "--kv-events-bind", events]
            if policy != SGLANG_ROUTER and planner_settings(policy).priorities:
                # As the virtual driver deploys a planner that ranks calls: its engines
                # schedule by the `priority` it sends.
                sim_args += ["--scheduling-policy", "priority"]
                gateway_args += ["--scheduling-policy", "priority"]
            if o.transfer_link().enabled:
                # Every engine runs the NIXL connector; the gateway moves KV for policies whose
                # peer does (the link is the simulated fabric's).
                sim_args += ["--kv-transfer-config", NIXL_CONFIG, "--kv-link", o.link]
                gateway_args += ["--kv-link", o.link]
            sims = [start_sim(f"{policy}-sim-{i}", log_dir, sim_args)
                    for i in range(o.engines)]
            children += sims
            urls = [s.url for s in sims]
            if policy == SGLANG_ROUTER:
                front = start_sglang_router(urls, log_dir)
            else:
                front = start_gateway(urls, log_dir, gateway_args, name=f"{policy}-gateway")
        children.append(front)
        before = [engine_counters(u) for u in urls]
        moved_before = sum(engine_metric(u, "vllm:nixl_bytes_transferred_sum") for u in urls)
        client = LiveClient(front.url, prepared, scale, policy, o.progress, model)
        asyncio.run(client.run())
        after = [engine_counters(u) for u in urls]
        # Counters of engines that outlive the run are differences over it.
        computed = int(sum((q1 - h1) - (q0 - h0)
                           for (h0, q0, _), (h1, q1, _) in zip(before, after, strict=True)))
        moved = int(sum(engine_metric(u, "vllm:nixl_bytes_transferred_sum") for u in urls)
                    - moved_before)
        return RunResult(policy, client.records, list(client.workflows.values()), {}, {}, 1.0,
                         computed, transferred_bytes=moved)
    finally:
        for c in reversed(children):
            c.stop()


def dag_headers(wf: BenchWorkflow, task: BenchTask) -> dict[str, str]:
    """What an agent built with kvgate's SDK sends with each call: the session, and its place
    in the DAG as hint-mode headers (workflow, task, the parents it waits for, how many calls
    will extend it), so a kvgate gateway knows the DAG as the virtual driver's planner does.
    Routers that do not read them (every baseline's policy, sglang-router) ignore them."""
    children = sum(task.id in t.after for t in wf.tasks)
    headers = {"x-session-id": wf.id, "X-KVGate-Workflow": wf.id, "X-KVGate-Task": task.id}
    if task.after:
        headers["X-KVGate-After"] = ",".join(task.after)
    if children:
        headers["X-KVGate-Expect-Children"] = str(children)
    return headers


def run_live(o: BenchOptions, prepared: Prepared) -> dict[str, RunResult]:
    """Every policy, one after the other, on fresh processes (logs kept on failure)."""
    scale = (o.time_scale if o.time_scale is not None
             else 1.0 if existing_engines(o) else default_time_scale(o.engine_profile().name))
    if scale <= 0:
        raise WorkloadError("--time-scale must be positive")
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-bench-live-"))
    runs: dict[str, RunResult] = {}
    try:
        for policy in o.policies:
            runs[policy] = run_policy(o, prepared, policy, log_dir, scale)
    except StartupError as e:
        raise WorkloadError(f"live mode could not start its processes (logs in {log_dir}): "
                            f"{e}") from None
    shutil.rmtree(log_dir, ignore_errors=True)
    return runs
