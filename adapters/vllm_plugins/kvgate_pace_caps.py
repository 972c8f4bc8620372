"""kvgate's pacing caps as a request carries them in `vllm_xargs` (vLLM's
`SamplingParams.extra_args`), read without vLLM: the scheduler plugin (kvgate_pace.py, which
imports this module by its top-level name from the same directory) and the simulated engine's
server (adapters/sim/server.py) read them alike.

- `kvgate_prefill_cap`: N, a positive integer: at most N prompt tokens per step while another
  request decodes.
- `kvgate_prefill_caps`: [t0, c0, t1, c1, ...], a flat list of integers (vLLM takes a
  `vllm_xargs` value as a string, a number or a flat list of them): from `t_i` computed prompt
  tokens on, the cap is `c_i`. The planner lowers the cap as the prompt gets on, since a token
  further in attends to more (planner.core, `Planner._pace_in_engine`).

Anything else there (not integers, caps not positive, tokens not rising, an odd length) is no
cap, as vLLM's own scheduler would run the request.
"""

from __future__ import annotations

import itertools
from typing import Any

CAP_ARG = "kvgate_prefill_cap"
CAPS_ARG = "kvgate_prefill_caps"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_caps(extra_args: Any) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(the first cap, the later `(computed_tokens, cap)` steps) from `extra_args`; (0, ())
    for none."""
    if not isinstance(extra_args, dict):
        return 0, ()
    cap = _int(extra_args.get(CAP_ARG))
    first = cap if cap is not None and cap > 0 else 0
    raw = extra_args.get(CAPS_ARG)
    flat = [_int(v) for v in raw] if isinstance(raw, list) else []
    ints = [v for v in flat if v is not None]
    if not ints or len(ints) != len(flat) or len(ints) % 2:
        return first, ()
    steps = tuple((ints[i], ints[i + 1]) for i in range(0, len(ints), 2))
    if any(c <= 0 or t < 0 for t, c in steps) or any(
            a[0] >= b[0] for a, b in itertools.pairwise(steps)):
        return first, ()
    return first, steps


def cap_at(first: int, steps: tuple[tuple[int, int], ...], computed: int) -> int:
    """The cap once `computed` prompt tokens are computed."""
    cap = first
    for start, c in steps:
        if start > computed:
            break
        cap = c
    return cap
