"""Micro-benchmark of prompt keying for an agent workload: a long static prefix, a short tail.

Every call repeats an ~8k-token system prompt with tool definitions and asks a different
question, which is what `PromptKeyer`'s prefix cache is for. Run `python -m
kvgate.benchmarks.lookup` to print the numbers.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

from kvindex.keys import PromptKeyer
from kvindex.tokenizer import Tokenizer

__all__ = ["agent_chat", "bench_keys"]

_VOCABULARY = (
    "agent plan tool search file read write compute result error retry cache block prefix "
    "engine request token latency budget report summary table column value index query user "
    "the a of to and in for with on by from as is are be this that when then else always never"
)
_WORDS = _VOCABULARY.split()


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + "."


def agent_chat(turn: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Messages and tools of call `turn`: a fixed system prompt and tools (about 8k tokens with
    the shipped tokenizer), then a user question that differs per turn."""
    rng = random.Random(7)
    system = "\n".join(
        " ".join(_sentence(rng, rng.randint(6, 18)) for _ in range(6)) for _ in range(50)
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": _sentence(rng, 30),
                "parameters": {
                    "type": "object",
                    "properties": {
                        f"arg_{j}": {"type": "string", "description": _sentence(rng, 8)}
                        for j in range(4)
                    },
                    "required": ["arg_0"],
                },
            },
        }
        for i in range(16)
    ]
    question = f"Turn {turn}: " + _sentence(random.Random(turn), 25)
    return [{"role": "system", "content": system}, {"role": "user", "content": question}], tools


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def bench_keys(iterations: int = 200, block_size: int = 16) -> dict[str, float]:
    """Time `PromptKeyer.chat` cold once, then warm `iterations` times with new questions.

    Returns microseconds: `cold_us`, `warm_p50_us`, `warm_p99_us` (wall clock), the same
    percentiles of the calling thread's CPU time (`warm_cpu_*`, immune to other processes
    preempting it), and `render_p50_us` (the chat template alone, part of every warm call); plus
    `prompt_tokens` of the cold prompt.
    """
    if iterations <= 0:
        raise ValueError("iterations must be positive")
    tokenizer = Tokenizer.load()
    keyer = PromptKeyer(tokenizer, block_size)
    # Compile the chat template first: the cold number is about an unseen prompt, not start-up.
    tokenizer.render_chat([{"role": "user", "content": "warm-up"}])
    messages, tools = agent_chat(0)
    start = time.perf_counter()
    cold = keyer.chat(messages, tools=tools)
    cold_us = (time.perf_counter() - start) * 1e6

    warm: list[float] = []
    warm_cpu: list[float] = []
    render: list[float] = []
    for turn in range(1, iterations + 1):
        messages, tools = agent_chat(turn)
        start = time.perf_counter()
        cpu_start = time.thread_time()
        keyer.chat(messages, tools=tools)
        warm_cpu.append((time.thread_time() - cpu_start) * 1e6)
        warm.append((time.perf_counter() - start) * 1e6)
        start = time.perf_counter()
        tokenizer.render_chat(messages, tools=tools)
        render.append((time.perf_counter() - start) * 1e6)
    warm.sort()
    warm_cpu.sort()
    render.sort()
    return {
        "prompt_tokens": float(cold.num_tokens),
        "cold_us": cold_us,
        "warm_p50_us": _percentile(warm, 0.5),
        "warm_p99_us": _percentile(warm, 0.99),
        "warm_cpu_p50_us": _percentile(warm_cpu, 0.5),
        "warm_cpu_p99_us": _percentile(warm_cpu, 0.99),
        "render_p50_us": _percentile(render, 0.5),
    }


if __name__ == "__main__":
    print(bench_keys())
