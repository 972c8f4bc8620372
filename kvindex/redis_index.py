"""A `KVIndexBackend` in Redis, so several gateway processes share one KV index.

Data model (every name starts with the namespace `ns`, default "kvgate"; keys are decimal ints,
tiers upper-case, engines any string — none of them is ever parsed back out of a Redis *key*):

  {ns}:b:{key}      HASH   field "{TIER}|{engine}" -> copies held (>= 1; field deleted at 0,
                           the hash disappears with its last field). One HGETALL per block
                           answers "who holds it, in which tier" for every tier at once.
  {ns}:e:{engine}   SET    members "{TIER}|{key}": the engine's confirmed entries, so
                           `clear_engine` and `engine_keys` need no SCAN.
  {ns}:s:{key}      HASH   field engine -> speculative expiry (epoch ms, Redis server clock);
                           PEXPIRE'd to its latest field as a memory safety net.
  {ns}:se:{engine}  ZSET   member key, score expiry: the engine's speculative entries (for
                           `clear_engine` and `stats`); pruned of expired members on each
                           `add_speculative`, PEXPIRE'd like the per-key hashes.
  {ns}:engines      SET    engines added (confirmed or speculatively) and not cleared.
  {ns}:stats        HASH   "keys" (block hashes) and "entries" (fields in them), kept by the
                           scripts so `stats` is O(engines).

Every write is a Lua script, so each call (each chunk of `CHUNK` keys for long key lists) is
atomic: concurrent writers from several processes never leave a negative count, a set member
without its hash field or the other way round. `clear_engine` runs in chunks too (SPOP), so a
match running meanwhile may see an engine half-cleared. `match` is one script call (one round
trip) for the whole prompt: the script walks the keys exactly like InMemoryIndex.match_sync (tier
weights passed from TIER_WEIGHTS), stops reading as soon as no engine still holds the prefix,
and returns four values per engine, not the per-block data (decoding that cost more than Redis).

Speculative expiry uses the Redis server's clock (`TIME` inside the scripts), never the caller's
`now`: gateway processes share neither a monotonic clock nor, exactly, a wall clock, but they
all share the server. `ttl_s` is honoured as a duration; the `now` arguments of
`add_speculative` and `match` are accepted for protocol compatibility and ignored.

The scripts build key names from the namespace, so this needs a standalone (or Sentinel) Redis,
not Redis Cluster.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from kvindex.index import (
    DEFAULT_TIER,
    TIER_WEIGHTS,
    BlockKey,
    EngineMatch,
    IndexStats,
    IndexUnavailable,
    tier_weight,
)

CHUNK = 1000
"""Keys per script call in add/remove/add_speculative/clear_engine (bounds Redis blocking)."""

_SEP = "|"

# ARGV: ns, engine, tier, key...  (tier already upper-case)
_ADD = """
local ns, engine, tier = ARGV[1], ARGV[2], ARGV[3]
local field = tier .. '|' .. engine
local eset = ns .. ':e:' .. engine
local sz = ns .. ':se:' .. engine
local new_keys, new_entries = 0, 0
redis.call('SADD', ns .. ':engines', engine)
for i = 4, #ARGV do
  local k = ARGV[i]
  local b = ns .. ':b:' .. k
  if redis.call('HINCRBY', b, field, 1) == 1 then
    new_entries = new_entries + 1
    if redis.call('HLEN', b) == 1 then new_keys = new_keys + 1 end
    redis.call('SADD', eset, tier .. '|' .. k)
  end
  if redis.call('HDEL', ns .. ':s:' .. k, engine) == 1 then redis.call('ZREM', sz, k) end
end
if new_entries > 0 then
  redis.call('HINCRBY', ns .. ':stats', 'entries', new_entries)
  if new_keys > 0 then redis.call('HINCRBY', ns .. ':stats', 'keys', new_keys) end
end
return new_entries
"""

# ARGV: ns, engine, tier, key...
_REMOVE = """
local ns, engine, tier = ARGV[1], ARGV[2], ARGV[3]
local field = tier .. '|' .. engine
local eset = ns .. ':e:' .. engine
local sz = ns .. ':se:' .. engine
local gone_keys, gone_entries = 0, 0
for i = 4, #ARGV do
  local k = ARGV[i]
  local b = ns .. ':b:' .. k
  local n = tonumber(redis.call('HGET', b, field))
  if n then
    if n > 1 then
      redis.call('HINCRBY', b, field, -1)
    else
      redis.call('HDEL', b, field)
      redis.call('SREM', eset, tier .. '|' .. k)
      gone_entries = gone_entries + 1
      if redis.call('EXISTS', b) == 0 then gone_keys = gone_keys + 1 end
    end
  end
  if redis.call('HDEL', ns .. ':s:' .. k, engine) == 1 then redis.call('ZREM', sz, k) end
end
if gone_entries > 0 then
  redis.call('HINCRBY', ns .. ':stats', 'entries', -gone_entries)
  if gone_keys > 0 then redis.call('HINCRBY', ns .. ':stats', 'keys', -gone_keys) end
end
return gone_entries
"""

# ARGV: ns, engine, ttl_ms, key...  Keys the engine holds confirmed in GPU are skipped.
_ADD_SPEC = """
local ns, engine, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expires = now + ttl
local gpu = 'GPU|' .. engine
local sz = ns .. ':se:' .. engine
redis.call('SADD', ns .. ':engines', engine)
redis.call('ZREMRANGEBYSCORE', sz, '-inf', string.format('%.0f', now))
for i = 4, #ARGV do
  local k = ARGV[i]
  local s = ns .. ':s:' .. k
  if ttl <= 0 then
    redis.call('HDEL', s, engine)
    redis.call('ZREM', sz, k)
  elseif redis.call('HEXISTS', ns .. ':b:' .. k, gpu) == 0 then
    redis.call('HSET', s, engine, string.format('%.0f', expires))
    local left = redis.call('PTTL', s)
    if left < ttl then redis.call('PEXPIRE', s, ttl) end
    redis.call('ZADD', sz, expires, k)
  end
end
if ttl > 0 and redis.call('EXISTS', sz) == 1 then
  local left = redis.call('PTTL', sz)
  if left < ttl then redis.call('PEXPIRE', sz, ttl) end
end
return 0
"""

# ARGV: ns, engine, chunk.  Pops up to `chunk` confirmed entries of the engine and deletes them;
# once none is left, also drops its speculative entries and forgets it. Returns entries left.
_CLEAR = """
local ns, engine, chunk = ARGV[1], ARGV[2], tonumber(ARGV[3])
local eset = ns .. ':e:' .. engine
local members = redis.call('SPOP', eset, chunk)
local gone_keys, gone_entries = 0, 0
for _, m in ipairs(members) do
  local sep = string.find(m, '|', 1, true)
  local tier, k = string.sub(m, 1, sep - 1), string.sub(m, sep + 1)
  local b = ns .. ':b:' .. k
  if redis.call('HDEL', b, tier .. '|' .. engine) == 1 then
    gone_entries = gone_entries + 1
    if redis.call('EXISTS', b) == 0 then gone_keys = gone_keys + 1 end
  end
end
if gone_entries > 0 then
  redis.call('HINCRBY', ns .. ':stats', 'entries', -gone_entries)
  if gone_keys > 0 then redis.call('HINCRBY', ns .. ':stats', 'keys', -gone_keys) end
end
local left = redis.call('SCARD', eset)
if left == 0 then
  local sz = ns .. ':se:' .. engine
  for _, k in ipairs(redis.call('ZRANGE', sz, 0, -1)) do
    redis.call('HDEL', ns .. ':s:' .. k, engine)
  end
  redis.call('DEL', sz)
  redis.call('SREM', ns .. ':engines', engine)
end
return left
"""

# ARGV: ns, default weight, n_weights, (tier, weight) x n_weights, n_filter (-1: every engine),
# engine x n_filter, key...  Walks the keys like InMemoryIndex.match_sync: a block counts for an
# engine if it holds it confirmed in some tier (weight of the best such tier) or has a live
# speculative entry (weight 1); the walk stops when no engine holds the whole prefix. Returns a
# flat list: engine, blocks, confirmed_blocks, penalty (sum of 1 - weight, in key order, as
# "%.17g" so the float survives), for engines holding at least one block.
_MATCH = """
local ns = ARGV[1]
local default_w = tonumber(ARGV[2])
local weights = {}
local a = 4
for _ = 1, tonumber(ARGV[3]) do
  weights[ARGV[a]] = tonumber(ARGV[a + 1])
  a = a + 2
end
local nf = tonumber(ARGV[a])
a = a + 1
local alive = nil
if nf >= 0 then
  alive = {}
  for j = a, a + nf - 1 do alive[ARGV[j]] = true end
  a = a + nf
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local length, conf_len, penalty = {}, {}, {}
local confirmed = nil
local n = 0
for i = a, #ARGV do
  local k = ARGV[i]
  local best, present, any = {}, {}, false
  local h = redis.call('HGETALL', ns .. ':b:' .. k)
  for j = 1, #h, 2 do
    local f = h[j]
    local sep = string.find(f, '|', 1, true)
    local e = string.sub(f, sep + 1)
    if alive == nil or alive[e] then
      local w = weights[string.sub(f, 1, sep - 1)] or default_w
      if best[e] == nil or w > best[e] then best[e] = w end
      present[e] = true
      any = true
    end
  end
  local s = redis.call('HGETALL', ns .. ':s:' .. k)
  for j = 1, #s, 2 do
    local e = s[j]
    if (alive == nil or alive[e]) and not present[e] and tonumber(s[j + 1]) > now then
      present[e] = true
      any = true
    end
  end
  if alive ~= nil then
    for e in pairs(alive) do
      if not present[e] then length[e] = n end
    end
  end
  if confirmed == nil then
    confirmed = {}
    for e in pairs(best) do confirmed[e] = true end
  else
    for e in pairs(confirmed) do
      if best[e] == nil then
        conf_len[e] = n
        confirmed[e] = nil
      end
    end
  end
  if not any then break end
  for e, w in pairs(best) do
    if w < 1 then penalty[e] = (penalty[e] or 0) + (1 - w) end
  end
  n = n + 1
  alive = present
end
if n > 0 then
  for e in pairs(alive) do length[e] = n end
  for e in pairs(confirmed) do conf_len[e] = n end
end
local out = {}
for e, blocks in pairs(length) do
  if blocks > 0 then
    out[#out + 1] = e
    out[#out + 1] = blocks
    out[#out + 1] = conf_len[e] or 0
    out[#out + 1] = string.format('%.17g', penalty[e] or 0)
  end
end
return out
"""

# ARGV: ns, engine.  Returns a flat list: "{TIER}|{key}", copies, ...
_ENGINE_KEYS = """
local ns, engine = ARGV[1], ARGV[2]
local out = {}
for _, m in ipairs(redis.call('SMEMBERS', ns .. ':e:' .. engine)) do
  local sep = string.find(m, '|', 1, true)
  local tier, k = string.sub(m, 1, sep - 1), string.sub(m, sep + 1)
  local n = redis.call('HGET', ns .. ':b:' .. k, tier .. '|' .. engine)
  if n then
    out[#out + 1] = m
    out[#out + 1] = n
  end
end
return out
"""

# ARGV: ns.  Returns keys, entries, live speculative entries, engines.
_STATS = """
local ns = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local keys = tonumber(redis.call('HGET', ns .. ':stats', 'keys')) or 0
local entries = tonumber(redis.call('HGET', ns .. ':stats', 'entries')) or 0
local engines = redis.call('SMEMBERS', ns .. ':engines')
local spec = 0
local after = string.format('(%.0f', now)
for _, e in ipairs(engines) do
  spec = spec + redis.call('ZCOUNT', ns .. ':se:' .. e, after, '+inf')
end
return {keys, entries, spec, #engines}
"""


def _weight_args() -> list[str]:
    """Tier weights for the match script, from TIER_WEIGHTS (the one source of truth)."""
    unknown = tier_weight(f"{_SEP}unknown")  # no real tier contains the separator
    args = [repr(unknown), str(len(TIER_WEIGHTS))]
    for tier in TIER_WEIGHTS:
        args += [tier.upper(), repr(tier_weight(tier))]
    return args


def _str(value: Any) -> str:
    """A reply element as str, whether the client decodes responses or not."""
    if isinstance(value, bytes):
        return value.decode()
    return str(value)


def _tier(tier: str) -> str:
    name = tier.upper()
    if not name or _SEP in name:
        raise ValueError(f"invalid storage tier {tier!r}")
    return name


def _chunks(keys: Sequence[BlockKey]) -> list[list[str]]:
    """Keys as decimal strings, CHUNK at a time (one empty chunk for no keys)."""
    text = [str(int(k)) for k in keys]
    return [text[i:i + CHUNK] for i in range(0, len(text), CHUNK)] or [[]]


class RedisIndex:
    """The KV index in Redis; see the module docstring for the data model and semantics."""

    def __init__(
        self, client: aioredis.Redis, namespace: str = "kvgate", *, owns_client: bool = False
    ) -> None:
        if not namespace:
            raise ValueError("namespace must not be empty")
        self._r = client
        self._ns = namespace
        self._owns_client = owns_client
        self._add = client.register_script(_ADD)
        self._remove = client.register_script(_REMOVE)
        self._add_spec = client.register_script(_ADD_SPEC)
        self._clear = client.register_script(_CLEAR)
        self._match = client.register_script(_MATCH)
        self._engine_keys = client.register_script(_ENGINE_KEYS)
        self._stats = client.register_script(_STATS)

    @classmethod
    def from_url(cls, url: str, namespace: str = "kvgate", **client_kwargs: Any) -> RedisIndex:
        """An index on its own connection pool (extra keyword arguments go to the client),
        closed by `close`."""
        client = aioredis.Redis.from_url(url, **{"decode_responses": True, **client_kwargs})
        return cls(client, namespace, owns_client=True)

    async def _run(self, script: AsyncScript, args: list[Any]) -> Any:
        """One script call; IndexUnavailable when Redis cannot be reached or does not answer."""
        try:
            return await script(args=args)
        except (RedisError, OSError) as e:  # OSError: TimeoutError, a reset connection
            raise IndexUnavailable(f"the Redis index cannot be reached: {e}") from e

    async def ping(self) -> None:
        """See KVIndexBackend.ping."""
        try:
            await self._r.ping()
        except (RedisError, OSError) as e:
            raise IndexUnavailable(f"the Redis index cannot be reached: {e}") from e

    @property
    def namespace(self) -> str:
        """Prefix of every Redis key this index uses."""
        return self._ns

    # -- KVIndexBackend -------------------------------------------------------------------------

    async def add(self, engine: str, keys: Sequence[BlockKey], tier: str = DEFAULT_TIER) -> None:
        """See KVIndexBackend.add; atomic per chunk of CHUNK keys."""
        name = _tier(tier)
        for chunk in _chunks(keys):
            await self._run(self._add, [self._ns, engine, name, *chunk])

    async def remove(
        self, engine: str, keys: Sequence[BlockKey], tier: str = DEFAULT_TIER
    ) -> None:
        """See KVIndexBackend.remove; removing an unknown key is a no-op."""
        name = _tier(tier)
        for chunk in _chunks(keys):
            await self._run(self._remove, [self._ns, engine, name, *chunk])

    async def clear_engine(self, engine: str) -> None:
        """See KVIndexBackend.clear_engine; runs in chunks, so it is not atomic as a whole."""
        while int(await self._run(self._clear, [self._ns, engine, CHUNK])) > 0:
            pass

    async def add_speculative(
        self, engine: str, keys: Sequence[BlockKey], now: float, ttl_s: float
    ) -> None:
        """See KVIndexBackend.add_speculative; expiry runs on the Redis server clock (`now`
        is ignored), keys the engine holds confirmed in GPU are skipped."""
        ttl_ms = round(ttl_s * 1000)
        for chunk in _chunks(keys):
            await self._run(self._add_spec, [self._ns, engine, ttl_ms, *chunk])

    async def match(
        self, keys: Sequence[BlockKey], now: float, engines: Iterable[str] | None = None
    ) -> dict[str, EngineMatch]:
        """See KVIndexBackend.match; one script call, `now` is ignored (server clock)."""
        wanted = None if engines is None else list(dict.fromkeys(engines))
        if not keys or wanted == []:
            return {}
        head: list[str | int] = [-1] if wanted is None else [len(wanted), *wanted]
        weights = _weight_args()  # per call: TIER_WEIGHTS is a plain, mutable dict
        flat = await self._run(self._match,
                               [self._ns, *weights, *head, *(str(int(k)) for k in keys)])
        out: dict[str, EngineMatch] = {}
        for i in range(0, len(flat), 4):
            engine, blocks = _str(flat[i]), int(flat[i + 1])
            out[engine] = EngineMatch(engine=engine, blocks=blocks,
                                      confirmed_blocks=int(flat[i + 2]),
                                      weighted_blocks=blocks - float(_str(flat[i + 3])))
        return dict(sorted(out.items()))

    async def engine_key_count(self, engine: str) -> int:
        """See KVIndexBackend.engine_key_count: the size of the engine's member set."""
        try:
            return int(await self._r.scard(f"{self._ns}:e:{engine}"))
        except (RedisError, OSError) as e:
            raise IndexUnavailable(f"the Redis index cannot be reached: {e}") from e

    async def engine_keys(self, engine: str) -> dict[BlockKey, dict[str, int]]:
        """See KVIndexBackend.engine_keys."""
        flat = await self._run(self._engine_keys, [self._ns, engine])
        out: dict[BlockKey, dict[str, int]] = {}
        for i in range(0, len(flat), 2):
            tier, _, key = _str(flat[i]).partition(_SEP)
            out.setdefault(int(key), {})[tier] = int(flat[i + 1])
        return out

    async def stats(self) -> IndexStats:
        """See KVIndexBackend.stats; speculative entries are those not yet expired."""
        keys, entries, spec, engines = await self._run(self._stats, [self._ns])
        return IndexStats(keys=int(keys), entries=int(entries), speculative_entries=int(spec),
                          engines=int(engines))

    async def close(self) -> None:
        """Close the connection pool if this index created it (`from_url`)."""
        if self._owns_client:
            await self._r.aclose()

