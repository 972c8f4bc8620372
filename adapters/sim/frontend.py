"""vLLM's API server in front of a simulated engine: the cost of a request before the scheduler
sees it, and the queue it waits in when the server is busy.

Both drivers use it (the simulated server, `adapters/sim/server.py`, in engine time; the
virtual bench, `kvgate/bench/virtual.py`, in virtual time), so a request reaches the engine
model at the same moment in either.
"""

from __future__ import annotations

from planner.profiles import EngineProfile


class ApiServer:
    """When requests reach the scheduler: each costs `EngineProfile.server_latency` (its
    chat template, its prompt's parsing and block hashes), spent by one of `api_servers`
    processes that take requests one at a time in arrival order; with `api_servers` 0 the
    cost is latency alone and nothing queues."""

    def __init__(self, profile: EngineProfile, scale: float = 1.0) -> None:
        """`scale`: the driver's clock per second of the profile's (the simulated server's
        `--time-scale`)."""
        self.profile = profile
        self.scale = scale
        self._free_at = [0.0] * max(0, profile.api_servers)
        """When each server process is done with the requests it has taken."""

    def cost(self, chat: bool, prompt_tokens: int) -> float:
        """One request's own cost at the server (no queueing)."""
        return self.profile.server_latency(chat, prompt_tokens) * self.scale

    def admitted_at(self, now: float, chat: bool, prompt_tokens: int) -> float:
        """When a request arriving at `now` reaches the scheduler (its process taken, in
        arrival order: the one free first)."""
        cost = self.cost(chat, prompt_tokens)
        free_at = self._free_at
        if not free_at:
            return now + cost
        i = min(range(len(free_at)), key=free_at.__getitem__)
        done = max(now, free_at[i]) + cost
        free_at[i] = done
        return done
