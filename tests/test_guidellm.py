"""A third-party load generator, guidellm, runs its own benchmark through the gateway.

guidellm (PyPI, pinned below) is installed in a venv of its own (tests/tool_venv.py: it brings
torch and transformers, which stay out of the project's venv) and run as its users run it: its
CLI, its OpenAI HTTP backend, synthetic multi-turn chats that share a system prefix, streamed,
four at a time. The gateway is a real `kvgate serve` in front of the two shared simulated
engines; guidellm's JSON report, the gateway's `/metrics` and the engines' own prefix-cache
counters are read after the run.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate.assets.tiny_tokenizer import TOKENIZER_DIR
from kvgate.procs import Child, start_gateway
from tests.conftest import MODEL
from tests.test_gateway_metrics import Samples, scrape, series, value
from tests.tool_venv import tool_venv

GUIDELLM = ["guidellm==0.8.1"]
# The CPU build of torch on this machine's disk; without it guidellm's bare "torch" pulls a
# CUDA build of several GB.
TORCH_CPU = ["torch==2.13.0"]
REQUESTS = 24
OUTPUT_TOKENS = 16


@pytest.fixture(scope="module")
def guidellm() -> Path:
    venv = tool_venv("guidellm-0.8.1", [TORCH_CPU, GUIDELLM])
    return venv / "bin" / "guidellm"


@pytest.fixture
def own_gateway(sims: list[Child], log_dir: Path) -> Iterator[Child]:
    """A gateway of this test's own, so its counters start at zero."""
    child = start_gateway([s.url for s in sims], log_dir, name="guidellm-gateway")
    yield child
    child.stop()


def engine_hits(sims: list[Child]) -> float:
    total = 0.0
    for s in sims:
        for v in series(scrape(s.url), "vllm:prefix_cache_hits_total").values():
            total += v
    return total


def test_guidellm_multi_turn_benchmark_through_the_gateway(
        guidellm: Path, own_gateway: Child, sims: list[Child], tmp_path: Path) -> None:
    hits_before = engine_hits(sims)
    report = tmp_path / "guidellm.json"
    cmd = [
        str(guidellm), "run",
        "--backend", f"kind=openai_http,target={own_gateway.url},model={MODEL}",
        "--profile", "kind=concurrent,streams=4",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        # Conversations of two turns opening with one shared 512-token system prefix.
        "--data", f"kind=synthetic_text,prompt_tokens=96,output_tokens={OUTPUT_TOKENS},"
                  "prefix_tokens=512,prefix_count=1,turns=2",
        "--tokenizer", f"kind=hf_auto,model={TOKENIZER_DIR}",
        "--output", f"kind=json,path={report}",
        "--disable-console",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL, cwd=tmp_path, check=False)
    assert run.returncode == 0, f"guidellm failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"

    bench = json.loads(report.read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    assert totals == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}
    output = bench["metrics"]["text"]["tokens"]["output"]["successful"]
    assert output["total_sum"] == REQUESTS * OUTPUT_TOKENS
    assert bench["metrics"]["time_to_first_token_ms"]["successful"]["count"] == REQUESTS

    gw: Samples = scrape(own_gateway.url)
    assert value(gw, "kvgate_requests_total", route="/v1/chat/completions",
                 status="200") == REQUESTS
    routed = series(gw, "kvgate_routed_requests_total")
    assert sum(routed.values()) == REQUESTS, routed
    # 24 calls sharing a 512-token prefix on two engines: the engines served some of it from
    # their prefix caches (their own counters, not the gateway's estimate).
    assert engine_hits(sims) - hits_before >= 512
