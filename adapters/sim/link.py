"""The simulated KV transfer fabric: one NIC per engine, shared by that engine's transfers.

Sans-IO like the engine model: `LinkModel.schedule(source, destination, bytes, now)` says when a
pull that starts now ends. Each engine has one NIC; a transfer occupies the NICs at both ends for
its bytes over the link's bandwidth, after the link's fixed setup latency, and transfers that
share a NIC take turns (first come, first served: the same total throughput as fair sharing, and
the earliest possible finish for the first of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.transfer import TransferLink


@dataclass
class LinkModel:
    """When each engine's NIC is next free, and what moved over it."""

    link: TransferLink
    nic_free_at: dict[str, float] = field(default_factory=dict)
    bytes_moved: int = 0
    transfers: int = 0

    def schedule(self, source: str, destination: str, num_bytes: int, now: float) -> float:
        """A transfer of `num_bytes` from `source` to `destination` asked for at `now`: the
        time it ends (both NICs are busy until then)."""
        if num_bytes < 0:
            raise ValueError("a transfer cannot move a negative number of bytes")
        free = self.nic_free_at
        start = max(now + self.link.setup_s, free.get(source, 0.0), free.get(destination, 0.0))
        done = start + num_bytes / self.link.bandwidth_bytes_s
        free[source] = free[destination] = done
        self.bytes_moved += num_bytes
        self.transfers += 1
        return done
