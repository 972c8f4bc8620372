"""KV transports to vLLM engines over HTTP: the NIXL two legs and the recompute warm-up.

Both are plain OpenAI `/v1/completions` calls with the prefix as token ids (VLLM_FACTS.md §6-7):
- `nixl_transfer`: leg 1 to the source with `kv_transfer_params: {"do_remote_decode": true}`,
  `max_tokens` 1, not streamed; the source answers with the `kv_transfer_params` that name its
  exported blocks (it holds them for its lease). Leg 2 sends the same token ids to the
  destination with those params, which pulls the blocks it lacks (NixlConnector) and keeps them
  in its prefix cache. This is how the upstream toy proxy drives a P/D pair; here the prefix
  alone is the prompt, so the legs replicate it.
- `warm`: the prefix alone, `max_tokens` 1, to one engine: it computes and caches it.
Both carry the origin request's `cache_salt`, which vLLM hashes into the first block: the copy
has the same KV identity as the origin's prefix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp


class TransportError(Exception):
    """A leg was refused or answered something unusable; the message names the engine."""


REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""Leg 1's params, as the upstream toy proxy sends them."""


async def _complete(session: aiohttp.ClientSession, url: str, name: str, body: dict[str, Any],
                    timeout_s: float, headers: Mapping[str, str] | None) -> dict[str, Any]:
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            text = (await r.read()).decode("utf-8", "replace")
            if r.status != 200:
                raise TransportError(f"engine {name} answered {r.status}: {text[:200]}")
    except (aiohttp.ClientError, TimeoutError) as e:
        raise TransportError(f"engine {name} unreachable: {e!r}") from None
    try:
        answer = json.loads(text)
    except ValueError:
        raise TransportError(f"engine {name} answered with invalid JSON") from None
    if not isinstance(answer, dict):
        raise TransportError(f"engine {name} answered a non-object")
    return answer


def _prefix(model: str, token_ids: Sequence[int], cache_salt: str | None) -> dict[str, Any]:
    """A leg's body: the prefix as token ids, one token out, under the origin's `cache_salt`
    (the salt is part of the KV's identity: unsalted, the copy would serve other tenants and
    not the origin's)."""
    body: dict[str, Any] = {"model": model, "prompt": list(token_ids), "max_tokens": 1,
                            "stream": False}
    if cache_salt:
        body["cache_salt"] = cache_salt
    return body


async def warm(session: aiohttp.ClientSession, url: str, name: str, model: str,
               token_ids: Sequence[int], timeout_s: float = 120.0,
               headers: Mapping[str, str] | None = None, cache_salt: str | None = None) -> None:
    """Compute the prefix on the engine (it stays in its prefix cache); `headers` go with the
    request (e.g. the move's `traceparent`)."""
    await _complete(session, url, name, _prefix(model, token_ids, cache_salt), timeout_s,
                    headers)


async def nixl_transfer(session: aiohttp.ClientSession, source: tuple[str, str],
                        destination: tuple[str, str], model: str, token_ids: Sequence[int],
                        timeout_s: float = 120.0, headers: Mapping[str, str] | None = None,
                        cache_salt: str | None = None) -> dict[str, Any]:
    """Copy the prefix's KV from `source` to `destination` ((name, url) each) by the two legs;
    returns the params leg 1 answered (what leg 2 pulled). `headers` go with both legs."""
    src_name, src_url = source
    dst_name, dst_url = destination
    first = await _complete(session, src_url, src_name, {
        **_prefix(model, token_ids, cache_salt), "kv_transfer_params": dict(REMOTE_DECODE)},
        timeout_s, headers)
    params = first.get("kv_transfer_params")
    if not isinstance(params, dict) or not params.get("remote_block_ids"):
        raise TransportError(f"engine {src_name} exported no KV blocks (is it running a KV "
                             "connector such as NixlConnector?)")
    await _complete(session, dst_url, dst_name, {
        **_prefix(model, token_ids, cache_salt), "kv_transfer_params": params},
        timeout_s, headers)
    return params
