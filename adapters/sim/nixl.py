"""The simulated engine's KV connector: vLLM's NixlConnector as its HTTP clients see it.

A simulated engine started with `--kv-transfer-config '{"kv_connector":"NixlConnector",...}'`
answers the two legs exactly as vLLM's connector does (VLLM_FACTS.md §6-7):
- a request with `kv_transfer_params: {"do_remote_decode": true}` finishes normally, keeps its
  prompt's blocks for a peer and answers `kv_transfer_params` naming them
  (`do_remote_prefill`, `remote_block_ids`, `remote_engine_id`, `remote_request_id`,
  `remote_host`, `remote_port`, `tp_size`);
- a request with those params (`do_remote_prefill: true`) pulls the blocks its own prefix
  cache lacks from the named peer instead of computing them.
NIXL's data path is replaced by the side channel below: the consumer asks the producer's server
(`remote_host:remote_port`) to "read" the blocks; the producer times the read on its link model
(`--kv-link`: one NIC, transfers take turns), frees the blocks when it is over and answers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from adapters.sim.model import RemotePrefill

SIDE_CHANNEL_PATH = "/_kvgate_sim/nixl/read"
"""The producer's endpoint a consumer reads exported blocks through (not part of vLLM's API:
it stands in for NIXL's transfer between the two engines' memories)."""

HEARTBEAT_PATH = "/_kvgate_sim/nixl/heartbeat"
"""Where a consumer renews the leases of the exports its waiting requests will read (NIXL's
heartbeat notification, sent every lease/6 while such a request waits at the consumer)."""
RELEASE_PATH = "/_kvgate_sim/nixl/release"
"""Where a consumer whose request ended before it read frees the producer's export at once
(vLLM's consumer notifies the producer with no blocks to read)."""

CONNECTORS = ("NixlConnector",)


class ConnectorConfigError(ValueError):
    """A `--kv-transfer-config` the simulated engine cannot run; the message names the key."""


@dataclass(frozen=True)
class ConnectorConfig:
    """The parts of vLLM's `KVTransferConfig` the simulated connector honours."""

    kv_connector: str
    kv_role: str
    lease_s: float = 30.0
    """`kv_connector_extra_config.kv_lease_duration`: how long exported blocks are held."""
    engine_id: str | None = None
    """`engine_id` (vLLM's default: a fresh uuid)."""
    load_failure_policy: str = "fail"
    """`kv_load_failure_policy`: `fail` (vLLM 0.32's default: the request ends in an error)
    or `recompute`."""


def parse_connector_config(text: str) -> ConnectorConfig:
    """vLLM's `--kv-transfer-config` JSON; errors name the bad key."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConnectorConfigError(f"--kv-transfer-config is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConnectorConfigError("--kv-transfer-config must be a JSON object")
    connector = data.get("kv_connector")
    if connector not in CONNECTORS:
        raise ConnectorConfigError(f"kv_connector {connector!r} is not simulated; known: "
                                   f"{', '.join(CONNECTORS)}")
    role = data.get("kv_role", "kv_both")
    if role not in ("kv_both", "kv_producer", "kv_consumer"):
        raise ConnectorConfigError(f"kv_role {role!r}: expected kv_both, kv_producer or "
                                   "kv_consumer")
    extra = data.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ConnectorConfigError("kv_connector_extra_config must be a JSON object")
    lease = extra.get("kv_lease_duration", 30.0)
    if not isinstance(lease, int | float) or lease <= 0:
        raise ConnectorConfigError(f"kv_connector_extra_config.kv_lease_duration must be a "
                                   f"positive number of seconds, got {lease!r}")
    policy = data.get("kv_load_failure_policy", "fail")
    if policy not in ("fail", "recompute"):
        raise ConnectorConfigError(f"kv_load_failure_policy {policy!r}: expected fail or "
                                   "recompute")
    engine_id = data.get("engine_id")
    if engine_id is not None and not isinstance(engine_id, str):
        raise ConnectorConfigError("engine_id must be a string")
    return ConnectorConfig(connector, role, float(lease), engine_id, policy)


@dataclass(frozen=True)
class Peer:
    """Where a consumer reads its blocks from."""

    host: str
    port: int


def request_params(params: Any) -> tuple[bool, RemotePrefill | None, Peer | None]:
    """A request's `kv_transfer_params`: (produce for a peer, consume from a peer, that peer).
    Raises ValueError naming a malformed field."""
    if params is None:
        return False, None, None
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be an object")
    if params.get("do_remote_prefill"):
        ids = params.get("remote_block_ids")
        engine_id = params.get("remote_engine_id")
        rid = params.get("remote_request_id")
        host, port = params.get("remote_host"), params.get("remote_port")
        # One list of block ids per KV-cache group (vLLM 0.32); a plain model has one group.
        if (not isinstance(ids, list) or len(ids) != 1 or not isinstance(ids[0], list)
                or not all(type(b) is int for b in ids[0])):
            raise ValueError("kv_transfer_params.remote_block_ids must be a list with one list "
                             "of block ids per KV-cache group (this engine has one group)")
        ids = ids[0]
        if not isinstance(engine_id, str) or not isinstance(rid, str):
            raise ValueError("kv_transfer_params needs remote_engine_id and remote_request_id")
        if not isinstance(host, str) or type(port) is not int:
            raise ValueError("kv_transfer_params needs remote_host and remote_port")
        cached = params.get("remote_prefill_cached_tokens")
        return False, RemotePrefill(engine_id, rid, tuple(ids),
                                    cached if type(cached) is int else None), Peer(host, port)
    return bool(params.get("do_remote_decode")), None, None


def producer_params(engine_id: str, request_id: str, block_ids: tuple[int, ...], host: str,
                    port: int, num_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """What a finished producer request answers, field for field as vLLM 0.32's
    `NixlPullConnectorScheduler.request_finished` builds it (one KV-cache group), with the
    producer's own prefix-cache hit the scheduler adds (`remote_prefill_cached_tokens`)."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [list(block_ids)], "remote_engine_id": engine_id,
            "remote_request_id": request_id, "remote_host": host, "remote_port": port,
            "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": num_tokens,
            "remote_blocks_expiry_time": None, "transfer_mode": "pull",
            "remote_prefill_cached_tokens": cached_tokens}
