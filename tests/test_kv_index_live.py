"""The gateway's KV index follows real simulated engines' KV events over real ZMQ.

Each cluster here is real processes on 127.0.0.1: `kvgate sim` engines publishing KV events and
a `kvgate serve` gateway ingesting them (bind mode unless stated), with the in-memory index or a
private redis-server.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.procs import Child, free_port, spawn, wait_healthy
from tests.conftest import MODEL
from tests.redis_server import RedisServer, redis_server_available

ADMIN = "test-admin-key-0123456789"
SYSTEM = ("You are the research agent number {n}. Use the tools to find evidence, cite every "
          "claim, state uncertainty and never invent sources. ") * 6


def http(method: str, url: str, body: Any = None, admin: bool = False,
         headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
    data = json.dumps(body).encode() if body is not None else None
    h = {"Content-Type": "application/json", **(headers or {})}
    if admin:
        h["Authorization"] = f"Bearer {ADMIN}"
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null"), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null"), dict(e.headers)


def chat(n: int, question: str = "What is known?") -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": SYSTEM.format(n=n)},
        {"role": "user", "content": question}]}


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Cluster:
    """Simulated engines + one or more gateways, all on free 127.0.0.1 ports."""

    tmp: Path
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    sims: dict[str, Child] = field(default_factory=dict)
    gateways: list[Child] = field(default_factory=list)
    events_port: int = 0

    def engine_name(self, name: str) -> str:
        return f"127.0.0.1:{self.engines[name]['port']}"

    def add_engine(self, name: str, replay: bool = True, drop: str = "",
                   lora: str = "") -> None:
        port = self.free_port()
        self.engines[name] = {"port": port, "replay": None}  # taken before its replay is given
        self.engines[name] |= {"replay": self.free_port() if replay else None,
                               "drop": drop, "lora": lora}

    def config_engines(self) -> list[dict[str, Any]]:
        out = []
        for e in self.engines.values():
            entry: dict[str, Any] = {"url": f"http://127.0.0.1:{e['port']}"}
            if e["replay"]:
                entry["kv_replay"] = f"tcp://127.0.0.1:{e['replay']}"
            out.append(entry)
        return out

    def free_port(self) -> int:
        """A free port that no engine of the cluster has been given yet (theirs are bound
        only when the engine starts, which may be after the gateway was given the same)."""
        taken = {p for e in self.engines.values() for p in (e["port"], e["replay"]) if p}
        while (port := free_port()) in taken or port == self.events_port:
            pass
        return port

    def start_gateway(self, ingest: bool = True, redis_url: str | None = None) -> Child:
        port = self.free_port()
        config: dict[str, Any] = {
            "host": "127.0.0.1", "port": port, "policy": "kvgate", "admin_key": ADMIN,
            "engines": self.config_engines(), "health_interval_s": 0.2,
            "scrape_interval_s": 0.2,
        }
        if ingest:
            self.events_port = self.events_port or self.free_port()
            config["kv_events_bind"] = f"tcp://127.0.0.1:{self.events_port}"
        if redis_url:
            config["index"] = {"backend": "redis", "redis_url": redis_url,
                               "namespace": f"t{port}"}
            if self.gateways:
                config["index"]["namespace"] = self.namespace
        self.namespace = config.get("index", {}).get("namespace", "")
        path = self.tmp / f"gateway-{port}.yaml"
        path.write_text(yaml.safe_dump(config))
        gw = spawn(f"gateway-{port}", ["serve", "--config", str(path)],
                   f"http://127.0.0.1:{port}", self.tmp)
        self.gateways.append(gw)
        return gw

    def start_sim(self, name: str) -> Child:
        e = self.engines[name]
        args = ["sim", "--host", "127.0.0.1", "--port", str(e["port"]), "--model", MODEL,
                "--kv-events", f"tcp://127.0.0.1:{self.events_port}",
                "--enable-prompt-tokens-details"]
        if e["replay"]:
            args += ["--kv-replay", f"tcp://127.0.0.1:{e['replay']}"]
        if e["drop"]:
            args += ["--kv-drop-seqs", e["drop"]]
        if e.get("lora"):
            args += ["--lora-modules", f"{e['lora']}=/loras/{e['lora']}"]
        child = spawn(f"{name}-{len(self.sims)}", args, f"http://127.0.0.1:{e['port']}",
                      self.tmp)
        wait_healthy(child)
        self.sims[name] = child
        return child

    def index_keys(self, gateway: Child, name: str) -> set[str]:
        status, body, _ = http("GET", f"{gateway.url}/admin/index/{self.engine_name(name)}",
                               admin=True)
        assert status == 200, body
        return set(body["keys"])

    def pool_idle(self, gateway: Child) -> bool:
        status, body, _ = http("GET", f"{gateway.url}/admin/engines", admin=True)
        assert status == 200, body
        return all(e["running"] == 0 and e["waiting"] == 0 and e["in_flight"] == 0
                   for e in body["engines"])

    def prompt_keys(self, gateway: Child, body: dict[str, Any]) -> list[str]:
        status, out, _ = http("POST", f"{gateway.url}/admin/index/match", body, admin=True)
        assert status == 200, out
        return list(out["keys"])

    def stop(self) -> None:
        for c in [*self.gateways, *self.sims.values()]:
            c.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.stop()



def start(cluster: Cluster, names: list[str], redis_url: str | None = None) -> Child:
    for n in names:
        cluster.add_engine(n)
    gw = cluster.start_gateway(redis_url=redis_url)
    for n in names:
        cluster.start_sim(n)
    wait_healthy(gw)
    return gw


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_index_holds_exactly_the_blocks_the_engine_announced(
    cluster: Cluster, backend: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("redis_url") if backend == "redis" else None
    gw = start(cluster, ["a", "b"], url)
    body = chat(1)
    status, out, headers = http("POST", f"{gw.url}/v1/chat/completions", body)
    assert status == 200, out
    engine = headers["x-kvgate-engine"]
    name = "a" if engine == cluster.engine_name("a") else "b"
    prompt_tokens = out["usage"]["prompt_tokens"]
    expected = set(cluster.prompt_keys(gw, body)[: prompt_tokens // 16])
    wait_for(lambda: cluster.index_keys(gw, name) == expected, "the engine's blocks in the index")
    other = "b" if name == "a" else "a"
    assert cluster.index_keys(gw, other) == set()


def test_a_lora_adapters_blocks_are_keyed_apart_and_found(cluster: Cluster) -> None:
    # vLLM hashes the adapter's name into every block of a LoRA request, and says so in its
    # KV events; the gateway keys the request the same way once /v1/models lists the model
    # as an adapter (its `parent` is the base model).
    for n in ("a", "b"):
        cluster.add_engine(n, lora="sql-lora")
    gw = cluster.start_gateway()
    for n in ("a", "b"):
        cluster.start_sim(n)
    wait_healthy(gw)
    body = {**chat(1), "model": "sql-lora"}
    status, out, headers = http("POST", f"{gw.url}/v1/chat/completions", body)
    assert status == 200, out
    assert out["model"] == "sql-lora"  # as vLLM answers: the adapter asked for
    name = "a" if headers["x-kvgate-engine"] == cluster.engine_name("a") else "b"
    expected = set(cluster.prompt_keys(gw, body)[: out["usage"]["prompt_tokens"] // 16])
    wait_for(lambda: cluster.index_keys(gw, name) == expected,
             "the adapter's blocks in the index under the request's keys")
    assert expected.isdisjoint(cluster.prompt_keys(gw, chat(1)))  # the base model's


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_repeated_prefix_follows_its_cache_and_hits(
    cluster: Cluster, backend: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("redis_url") if backend == "redis" else None
    gw = start(cluster, ["a", "b", "c"], url)
    served = []
    cached = []
    for i in range(4):
        status, out, headers = http("POST", f"{gw.url}/v1/chat/completions",
                                    chat(2, f"Question {i}?"))
        assert status == 200, out
        served.append(headers["x-kvgate-engine"])
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        time.sleep(0.3)  # let the events land so placement uses confirmed blocks
    assert len(set(served)) == 1
    assert cached[0] == 0 and all(c > 200 for c in cached[1:])


def test_calls_sharing_a_request_id_at_once_are_each_answered(
    cluster: Cluster, redis_url: str,
) -> None:
    # Keying awaits the Redis index before the planner admits a call: two calls with one
    # x-request-id in that window were both given it (one then hung until its timeout).
    gw = start(cluster, ["a", "b"], redis_url)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(
            lambda i: http("POST", f"{gw.url}/v1/chat/completions", chat(3, f"Retry {i}?"),
                           headers={"x-request-id": "same-id"}), range(8)))
    assert [status for status, _, _ in answers] == [200] * 8, answers


def test_engine_restart_drops_its_stale_entries(cluster: Cluster) -> None:
    gw = start(cluster, ["a"])
    status, out, _ = http("POST", f"{gw.url}/v1/chat/completions", chat(3))
    assert status == 200
    wait_for(lambda: len(cluster.index_keys(gw, "a")) > 0, "blocks from engine a")

    def scraped() -> bool:
        _, body, _ = http("GET", f"{gw.url}/admin/engines", admin=True)
        return body["engines"][0]["process_start_time"] is not None

    wait_for(scraped, "a scrape of the engine's process start time")
    cluster.sims["a"].kill()
    cluster.start_sim("a")  # same port, a new process with an empty cache
    wait_for(lambda: cluster.index_keys(gw, "a") == set(), "stale entries to be dropped")
    status, out, _ = http("POST", f"{gw.url}/v1/chat/completions", chat(4))
    assert status == 200
    prompt_tokens = out["usage"]["prompt_tokens"]
    expected = set(cluster.prompt_keys(gw, chat(4))[: prompt_tokens // 16])
    wait_for(lambda: cluster.index_keys(gw, "a") == expected, "the new process's blocks")


def test_dropped_events_are_recovered_through_replay(cluster: Cluster) -> None:
    cluster.add_engine("a", replay=True, drop="1,2")
    gw = cluster.start_gateway()
    sim = cluster.start_sim("a")
    wait_healthy(gw)
    expected: set[str] = set()
    for n in range(5):
        status, out, _ = http("POST", f"{sim.url}/v1/chat/completions", chat(10 + n))
        assert status == 200
        expected |= set(cluster.prompt_keys(gw, chat(10 + n))[: out["usage"]["prompt_tokens"]
                                                              // 16])
    wait_for(lambda: cluster.index_keys(gw, "a") == expected, "replayed blocks in the index")
    with urllib.request.urlopen(f"{gw.url}/metrics") as r:
        text = r.read().decode()
    replays = [line for line in text.splitlines()
               if line.startswith("kvgate_kv_events_replays_requested_total ")]
    assert replays and float(replays[0].split()[1]) >= 1


def test_dropped_events_without_replay_never_leave_false_entries(cluster: Cluster) -> None:
    cluster.add_engine("a", replay=False, drop="1")
    gw = cluster.start_gateway()
    sim = cluster.start_sim("a")
    wait_healthy(gw)
    truth: set[str] = set()

    def send(n: int) -> set[str]:
        status, out, _ = http("POST", f"{sim.url}/v1/chat/completions", chat(20 + n))
        assert status == 200
        keys = cluster.prompt_keys(gw, chat(20 + n))[: out["usage"]["prompt_tokens"] // 16]
        truth.update(keys)
        return set(keys[:1])

    for n in range(4):
        last = send(n)
    # The gap is seen when the message after it arrives, and the resync then drops what that
    # message carried too; under load one message may carry several requests' events. Later
    # requests are indexed once the engine's stream is trusted again.
    for n in range(4, 10):
        try:
            wait_for(lambda last=last: last <= cluster.index_keys(gw, "a"),  # type: ignore[misc]
                     "events after the gap", 5.0)
            break
        except AssertionError:
            last = send(n)
    wait_for(lambda: last <= cluster.index_keys(gw, "a"), "events after the gap")
    held = cluster.index_keys(gw, "a")
    assert held and held <= truth and held != truth


def test_an_engine_leaving_the_pool_is_purged(cluster: Cluster) -> None:
    gw = start(cluster, ["a", "b"])
    http("POST", f"{gw.url}/v1/chat/completions", chat(5))
    wait_for(lambda: bool(cluster.index_keys(gw, "a") | cluster.index_keys(gw, "b")),
             "blocks in the index")
    with urllib.request.urlopen(f"{gw.url}/metrics", timeout=10) as r:
        assert r.read().decode().count("kvgate_engine_healthy{") == 2
    for name in ("a", "b"):
        status, body, _ = http("DELETE", f"{gw.url}/admin/engines/{cluster.engine_name(name)}",
                               admin=True)
        assert status == 200, body
        # Nothing of it is left: neither the pool nor the index knows it.
        status, body, _ = http(
            "GET", f"{gw.url}/admin/index/{cluster.engine_name(name)}", admin=True)
        assert status == 404, body
    status, body, _ = http("POST", f"{gw.url}/v1/chat/completions", chat(5))
    assert status == 503
    # Nor do the metrics say they are healthy, or keep any series of theirs (a pool whose
    # engines come and go would grow them without end).
    with urllib.request.urlopen(f"{gw.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert "kvgate_engine_healthy{" not in text
    for name in ("a", "b"):
        left = [line for line in text.splitlines()
                if f'engine="{cluster.engine_name(name)}"' in line]
        assert not left, left


def test_admin_api_needs_the_key(cluster: Cluster) -> None:
    gw = start(cluster, ["a"])
    status, body, _ = http("GET", f"{gw.url}/admin/engines")
    assert status == 401 and body["error"]["code"] == "invalid_admin_key"
    status, body, _ = http("GET", f"{gw.url}/admin/engines",
                           headers={"Authorization": "Bearer wrong"})
    assert status == 401
    status, body, _ = http("POST", f"{gw.url}/admin/engines", {"url": "nope"}, admin=True)
    assert status == 400 and "url" in body["error"]["message"]
    # A key that is not text is a wrong key, not a server error.
    status, body, _ = http("GET", f"{gw.url}/admin/engines",
                           headers={"Authorization": b"Bearer \xff"})  # type: ignore[dict-item]
    assert status == 401, body
    # Engines the gateway cannot take: a profile file it cannot read, an event endpoint libzmq
    # refuses. Each is a 400 naming it, and the pool is unchanged.
    for entry, fragment in (
            ({"url": "http://127.0.0.1:1", "profile_file": str(cluster.tmp)},
             "cannot read it as a profile file"),
            ({"url": "http://127.0.0.1:2", "kv_events": "tcp://a b:5557"},
             "cannot subscribe to KV events at 'tcp://a b:5557'")):
        status, body, _ = http("POST", f"{gw.url}/admin/engines", entry, admin=True)
        assert status == 400 and fragment in body["error"]["message"], body
    _, engines, _ = http("GET", f"{gw.url}/admin/engines", admin=True)
    assert [e["name"] for e in engines["engines"]] == [cluster.engine_name("a")]


def test_two_gateways_sharing_redis_send_a_prefix_to_the_same_engine(
    cluster: Cluster, redis_url: str
) -> None:
    for n in ("a", "b", "c", "d"):
        cluster.add_engine(n)
    first = cluster.start_gateway(redis_url=redis_url)
    second = cluster.start_gateway(ingest=False, redis_url=redis_url)
    for n in ("a", "b", "c", "d"):
        cluster.start_sim(n)
    wait_healthy(first)
    wait_healthy(second)
    status, out, headers = http("POST", f"{first.url}/v1/chat/completions", chat(6, "First?"))
    assert status == 200
    engine = headers["x-kvgate-engine"]
    name = next(n for n in cluster.engines if cluster.engine_name(n) == engine)
    wait_for(lambda: len(cluster.index_keys(second, name)) > 10, "shared index entries")
    # The second gateway prices foreign requests from its last /metrics scrape: one taken while
    # the first call still ran would read the holder as busy. Wait for a scrape that sees the
    # pool idle (before each call: one taken during the previous call would too), so the
    # choice below rests on the shared index alone.
    for i in range(3):
        wait_for(lambda: cluster.pool_idle(second), "an idle scrape on the second gateway")
        status, out, headers = http("POST", f"{second.url}/v1/chat/completions",
                                    chat(6, f"Follow-up {i}?"))
        assert status == 200
        assert headers["x-kvgate-engine"] == engine
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 200


@pytest.mark.skipif(not redis_server_available(), reason="redis-server not installed")
def test_a_redis_index_that_goes_away_routes_without_it_and_one_never_there_is_named(
    cluster: Cluster,
) -> None:
    cluster.add_engine("a")
    with RedisServer() as url:
        gw = cluster.start_gateway(redis_url=url)
        cluster.start_sim("a")
        wait_healthy(gw)
        status, _, _ = http("POST", f"{gw.url}/v1/chat/completions", chat(1))
        assert status == 200
    # Redis is gone. A prompt long enough to be looked up used to be a 500, and /metrics too.
    for i in range(3):
        status, out, _ = http("POST", f"{gw.url}/v1/chat/completions", chat(1, f"Again {i}?"))
        assert status == 200, out
    status, out, _ = http("GET", f"{gw.url}/admin/index/{cluster.engine_name('a')}",
                          admin=True)
    assert status == 503 and out["error"]["code"] == "index_unavailable", out
    with urllib.request.urlopen(f"{gw.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert r.status == 200
    count = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("kvgate_index_unavailable_total "))
    assert count >= 1
    log = gw.log_tail(100_000)
    assert "routing calls without the KV index" in log and "Traceback" not in log, log
    # A gateway whose index cannot be reached at start-up says so and exits.
    port = free_port()
    path = cluster.tmp / "no-redis.yaml"
    path.write_text(yaml.safe_dump({
        "port": port, "engines": cluster.config_engines(),
        "index": {"backend": "redis", "redis_url": f"redis://127.0.0.1:{free_port()}/0"}}))
    child = spawn("no-redis", ["serve", "--config", str(path)], f"http://127.0.0.1:{port}",
                  cluster.tmp)
    assert child.proc.wait(timeout=60) == 1
    assert "kvgate serve: cannot start: the Redis index cannot be reached" in child.log_tail()
    assert "Traceback" not in child.log_tail()


def test_connect_mode_subscribes_to_engines_that_bind(tmp_path: Path) -> None:
    pub, replay, sim_port, gw_port = free_port(), free_port(), free_port(), free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    sim = spawn("sim-bind", ["sim", "--host", "127.0.0.1", "--port", str(sim_port), "--model",
                             MODEL, "--kv-events", f"tcp://*:{pub}", "--kv-replay",
                             f"tcp://*:{replay}", "--enable-prompt-tokens-details"],
                sim_url, tmp_path)
    config = {"host": "127.0.0.1", "port": gw_port, "admin_key": ADMIN,
              "health_interval_s": 0.2, "scrape_interval_s": 0.2,
              "engines": [{"url": sim_url, "kv_events": f"tcp://127.0.0.1:{pub}",
                           "kv_replay": f"tcp://127.0.0.1:{replay}"}]}
    (tmp_path / "gw.yaml").write_text(yaml.safe_dump(config))
    gw = spawn("gateway-connect", ["serve", "--config", str(tmp_path / "gw.yaml")],
               f"http://127.0.0.1:{gw_port}", tmp_path)
    try:
        wait_healthy(sim)
        wait_healthy(gw)
        cluster = Cluster(tmp_path, engines={"a": {"port": sim_port}})
        body = chat(7)
        status, out, _ = http("POST", f"{gw.url}/v1/chat/completions", body)
        assert status == 200
        expected = set(cluster.prompt_keys(gw, body)[: out["usage"]["prompt_tokens"] // 16])
        wait_for(lambda: cluster.index_keys(gw, "a") == expected, "events over connect mode")
    finally:
        gw.stop()
        sim.stop()


class CuttableProxy:
    """A TCP relay to 127.0.0.1:`target` on a free port, in a thread, that can be cut (every
    connection reset, new ones refused) and restored: a store away while its data stays."""

    def __init__(self, target: int) -> None:
        import asyncio
        import threading

        self.target = target
        self.port = free_port()
        self.cut_now = False
        self._links: set[Any] = set()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def pipe(reader: Any, writer: Any) -> None:
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except (OSError, RuntimeError):
                pass
            finally:
                writer.close()

        async def handle(reader: Any, writer: Any) -> None:
            if self.cut_now:
                writer.transport.abort()
                return
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
            link = (writer, up_writer)
            self._links.add(link)
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
            self._links.discard(link)

        async def serve() -> None:
            await asyncio.start_server(handle, "127.0.0.1", self.port)
            ready.set()

        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(serve(), self.loop)
        ready.wait(10)

    def cut(self) -> None:
        def abort() -> None:
            self.cut_now = True
            for a, b in list(self._links):
                a.transport.abort()
                b.transport.abort()
        self.loop.call_soon_threadsafe(abort)

    def restore(self) -> None:
        self.cut_now = False


@pytest.mark.skipif(not redis_server_available(), reason="redis-server not installed")
def test_an_engine_removed_while_the_index_is_away_is_purged_once_it_is_back(
    cluster: Cluster,
) -> None:
    cluster.add_engine("a")
    cluster.add_engine("b")
    with RedisServer() as url:
        proxy = CuttableProxy(int(url.rsplit(":", 1)[1].split("/")[0]))
        gw = cluster.start_gateway(redis_url=f"redis://127.0.0.1:{proxy.port}/0")
        cluster.start_sim("a")
        cluster.start_sim("b")
        wait_healthy(gw)
        http("POST", f"{gw.url}/v1/chat/completions", chat(5))
        wait_for(lambda: bool(cluster.index_keys(gw, "a") | cluster.index_keys(gw, "b")),
                 "blocks in the index")
        holder = next(n for n in ("a", "b") if cluster.index_keys(gw, n))
        name = cluster.engine_name(holder)
        _, listed, _ = http("GET", f"{gw.url}/admin/engines", admin=True)
        counts = {e["name"]: e["index_keys"] for e in listed["engines"]}
        assert counts[name] == len(cluster.index_keys(gw, holder)) > 0
        proxy.cut()
        time.sleep(0.2)
        status, body, _ = http("DELETE", f"{gw.url}/admin/engines/{name}", admin=True)
        assert status == 503 and body["error"]["code"] == "index_unavailable", body
        # What the index holds is not known meanwhile: a 503, not an empty 200.
        status, body, _ = http("POST", f"{gw.url}/admin/index/match", chat(5), admin=True)
        assert status == 503, body
        proxy.restore()

        def once_back(method: str, path: str) -> tuple[int, Any]:
            # A pooled connection the cut left dead may fail one more call (redis-py makes it
            # again on its retry): such a 503 is the store still coming back.
            for _ in range(20):
                status, body, _ = http(method, f"{gw.url}{path}", admin=True)
                if status != 503:
                    return status, body
                time.sleep(0.2)
            return status, body

        # The engine left the pool; its entries, still in Redis, are purged when asked again
        # (it used to be a 404 for good, the entries matched by every replica).
        status, body = once_back("GET", f"/admin/index/{name}")
        assert status == 200 and body["keys"], body
        status, body = once_back("DELETE", f"/admin/engines/{name}")
        assert status == 200, body
        status, body = once_back("GET", f"/admin/index/{name}")
        assert status == 404 and body["error"]["code"] == "engine_not_found", body
        status, body = once_back("DELETE", f"/admin/engines/{name}")
        assert status == 404, body


def test_an_engine_added_at_run_time_is_checked_as_the_config_checks_it(
        cluster: Cluster) -> None:
    gw = start(cluster, ["a"])
    url = f"http://127.0.0.1:{cluster.engines['a']['port']}"
    for entry, status_code, fragment in (
            # A line break in a name went into every answer's x-kvgate-engine header: 500s.
            ({"url": "http://127.0.0.1:9", "name": "bad\r\nX-Injected: 1"}, 400, "engine name"),
            ({"url": "http://127.0.0.1:9", "name": ""}, 400, "engine name"),
            # One engine under a second address is not a second engine.
            ({"url": url.replace("127.0.0.1", "localhost"), "name": "again"}, 409,
             "are one engine"),
            ({"url": url, "name": "dup"}, 409, "are one engine")):
        status, body, _ = http("POST", f"{gw.url}/admin/engines", entry, admin=True)
        assert status == status_code and fragment in body["error"]["message"], body
    _, engines, _ = http("GET", f"{gw.url}/admin/engines", admin=True)
    assert [e["name"] for e in engines["engines"]] == [cluster.engine_name("a")]
    status, body, _ = http("GET", f"{gw.url}/admin/index/no-such-engine", admin=True)
    assert status == 404, body


def test_a_replica_that_does_not_subscribe_never_replays_into_the_shared_index(
    cluster: Cluster, redis_url: str
) -> None:
    from gateway.kv_events import PROBE_INTERVAL_S

    # One subscriber feeds the shared index; the other replica has the same engine entries
    # (their replay endpoints among them). Its probe of an engine it never heard from was a
    # first contact: it cleared the engine's shared entries and replayed them.
    cluster.add_engine("a")
    first = cluster.start_gateway(redis_url=redis_url)
    second = cluster.start_gateway(ingest=False, redis_url=redis_url)
    cluster.start_sim("a")
    wait_healthy(first)
    wait_healthy(second)
    http("POST", f"{first.url}/v1/chat/completions", chat(5))
    wait_for(lambda: bool(cluster.index_keys(first, "a")), "blocks in the shared index")
    time.sleep(3 * PROBE_INTERVAL_S)

    def last_seq(gw: Child) -> Any:
        _, body, _ = http("GET", f"{gw.url}/admin/engines", admin=True)
        return body["engines"][0]["last_event_seq"]

    assert last_seq(first) is not None
    assert last_seq(second) is None
    assert "replay" not in second.log_tail(10_000).lower()


def test_the_admin_match_sees_speculative_entries_and_leaves_them(cluster: Cluster) -> None:
    # It read the index on another clock than the gateway's: every speculative entry looked
    # expired, and the in-memory index deleted them all (the ones that send siblings after
    # the call that computes their prefix).
    cluster.add_engine("a")
    cluster.add_engine("b")
    gw = cluster.start_gateway(ingest=False)  # no KV events: only the gateway's own entries
    cluster.start_sim("a")
    cluster.start_sim("b")
    wait_healthy(gw)
    status, _, headers = http("POST", f"{gw.url}/v1/chat/completions", chat(5))
    assert status == 200
    for _ in range(2):
        status, out, _ = http("POST", f"{gw.url}/admin/index/match", chat(5), admin=True)
        assert status == 200 and out["matches"], out
        (engine,) = out["matches"]
        assert engine == headers["x-kvgate-engine"]
        assert out["matches"][engine]["confirmed_blocks"] == 0
