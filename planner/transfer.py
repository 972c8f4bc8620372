"""How KV moves between engines, as the planner sees it: the link, and a pull a placement asks for.

A link is what `--link nvlink|rdma|GBPS` and the gateway's `kv_transfer:` config name: bandwidth
and a fixed per-transfer latency (NIXL's handshake and descriptor setup). Transfers are carried
out by drivers (the NIXL two-leg flow, VLLM_FACTS.md §6-7); the planner only decides them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransferLink:
    """The KV transfer path between any two engines (0 bandwidth: no path, recompute only)."""

    bandwidth_bytes_s: float = 0.0
    """Per engine NIC, shared by that engine's concurrent transfers."""
    setup_s: float = 0.002
    """Fixed cost of one transfer: the two legs' handshake, descriptors, notification."""

    @property
    def enabled(self) -> bool:
        """KV can move at all."""
        return self.bandwidth_bytes_s > 0

    def seconds(self, num_bytes: float) -> float:
        """One transfer of `num_bytes` over an otherwise idle link."""
        if not self.enabled:
            raise ValueError("no KV transfer link configured")
        return self.setup_s + num_bytes / self.bandwidth_bytes_s


NO_LINK = TransferLink()

GB = 1e9

NAMED_LINKS: dict[str, TransferLink] = {
    # NVLink 4: 450 GB/s per direction per GPU (ANCHORS.md, hardware facts).
    "nvlink": TransferLink(450 * GB, 0.001),
    # A 400 Gb/s RDMA NIC: about 50 GB/s.
    "rdma": TransferLink(50 * GB, 0.002),
}


def parse_link(text: str) -> TransferLink:
    """`nvlink`, `rdma`, `none`, or a bandwidth in GB/s (e.g. `25`); ValueError names the bad
    value."""
    name = text.strip().lower()
    if name in NAMED_LINKS:
        return NAMED_LINKS[name]
    if name in ("none", "off", "0"):
        return NO_LINK
    try:
        gbps = float(name)
    except ValueError:
        raise ValueError(f"unknown link {text!r}: expected nvlink, rdma, none or a bandwidth "
                         "in GB/s") from None
    if gbps <= 0 or gbps != gbps or gbps == float("inf"):
        raise ValueError(f"link bandwidth must be a positive number of GB/s, got {text!r}")
    return TransferLink(gbps * GB, 0.002)


@dataclass(frozen=True)
class Pull:
    """A placement's request to copy the prompt's leading KV from `source` before it runs."""

    source: str
    tokens: int
    """Leading prompt tokens the destination holds once the pull is done (the source's run)."""
    reason: str = "pull"
    """`pull` (the source holds the prefix) or `disaggregate` (the source computes it first:
    prefill there, decode at the destination)."""
