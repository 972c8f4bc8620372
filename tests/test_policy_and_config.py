"""Routing policies choose sensibly; configs are validated with errors that name the bad key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from adapters.vllm.metrics import MetricsParseError, parse_engine_load
from gateway.app import exposure_warnings
from gateway.config import ConfigError, load_config, parse_config
from planner.policy import EngineView, NoEngineAvailable, RouteRequest, make_policy

REQ = RouteRequest(request_id="r", model="m")


def engine(name: str, running: int = 0, waiting: int = 0, in_flight: int = 0,
           healthy: bool = True, models: tuple[str, ...] = ("m",)) -> EngineView:
    return EngineView(name=name, healthy=healthy, models=frozenset(models), num_running=running,
                      num_waiting=waiting, in_flight=in_flight)


def test_least_loaded_picks_the_engine_with_fewest_requests() -> None:
    policy = make_policy("least-loaded")
    pool = [engine("a", running=4), engine("b", running=1, waiting=1), engine("c", running=3)]
    assert policy.choose(REQ, pool, 0.0) == "b"


def test_least_loaded_trusts_its_own_in_flight_count_over_a_stale_scrape() -> None:
    policy = make_policy("least-loaded")
    pool = [engine("a", in_flight=5), engine("b", running=2)]
    assert policy.choose(REQ, pool, 0.0) == "b"


def test_least_loaded_rotates_among_equally_loaded_engines() -> None:
    policy = make_policy("least-loaded")
    pool = [engine("a"), engine("b"), engine("c")]
    assert [policy.choose(REQ, pool, 0.0) for _ in range(6)] == ["a", "b", "c"] * 2


def test_round_robin_cycles_and_skips_unhealthy_engines() -> None:
    policy = make_policy("round-robin")
    pool = [engine("a"), engine("b", healthy=False), engine("c")]
    assert [policy.choose(REQ, pool, 0.0) for _ in range(4)] == ["a", "c", "a", "c"]


def test_no_engine_for_the_model_raises() -> None:
    policy = make_policy("least-loaded")
    with pytest.raises(NoEngineAvailable, match="serves this model"):
        policy.choose(REQ, [engine("a", models=("other",))], 0.0)
    with pytest.raises(NoEngineAvailable, match="no engine is healthy"):
        policy.choose(REQ, [engine("a", healthy=False)], 0.0)


def test_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="least-loaded"):
        make_policy("fastest")


def test_config_errors_name_every_bad_key() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"engines": [{"url": "localhost"}], "policy": "x", "port": 99999}, "t.yaml")
    text = str(info.value)
    assert "t.yaml: engines.0.url" in text
    assert "t.yaml: policy" in text
    assert "t.yaml: port" in text


def test_config_refuses_what_could_not_run(tmp_path: Path) -> None:
    engines = [{"url": "http://127.0.0.1:9"}]
    with pytest.raises(ConfigError, match="redis_url must start with redis://"):
        parse_config({"engines": engines, "index": {"backend": "redis",
                                                    "redis_url": "localhost:6379"}})
    with pytest.raises(ConfigError, match="redis_url must start with redis://"):
        parse_config({"engines": engines, "workflows": {"store": "redis",
                                                        "redis_url": "127.0.0.1"}})
    # Port 0 would listen on a port nobody knows, and the workflow API calls the gateway back.
    with pytest.raises(ConfigError, match="port"):
        parse_config({"engines": engines, "port": 0})
    with pytest.raises(ConfigError, match="cannot read it: Is a directory"):
        load_config(tmp_path)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"engines: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(binary)
    # A section left empty in the file takes the command line's setting; one that is not a
    # mapping is named.
    empty = tmp_path / "empty.yaml"
    empty.write_text("engines:\n  - url: http://127.0.0.1:9\nkv_transfer:\n")
    assert load_config(empty, **{"kv_transfer.link": "rdma"}).kv_transfer.link == "rdma"
    text = tmp_path / "text.yaml"
    text.write_text("engines:\n  - url: http://127.0.0.1:9\ntracing: console\n")
    with pytest.raises(ConfigError, match="tracing: expected a mapping of settings"):
        load_config(text, **{"tracing.endpoint": "http://127.0.0.1:4318"})


def test_config_refuses_what_used_to_be_taken_and_do_something_else(tmp_path: Path) -> None:
    engines = [{"url": "http://127.0.0.1:9"}]
    # A section given twice: the second silently replaced the first (here: tenants off).
    twice = tmp_path / "twice.yaml"
    twice.write_text("tenants:\n  acme: {keys: [sk-acme-0123456789abcdef]}\nengines:\n"
                     "  - url: http://127.0.0.1:9\ntenants: {}\n")
    with pytest.raises(ConfigError, match=r"key 'tenants' is given twice \(lines 1 and 5\)"):
        load_config(twice)
    for bad, problem in [
        ({"port": True}, "port: Value error, expected an integer, not true"),
        ({"retries": False}, "retries: Value error, expected an integer, not false"),
        ({"connect_timeout_s": True}, "connect_timeout_s: Value error, expected a number"),
        ({"host": ""}, "host: String should have at least 1 character"),
        ({"engine_api_key": "sk-engine-0123456789\n"}, "a line break"),
        ({"engine_api_key": ""}, "engine_api_key is empty"),
        ({"tokenizer": ""}, "tokenizer is empty"),
        ({"engines": [{"url": "http://127.0.0.1:9/v1"}]}, "no path, got 'http://127.0.0.1:9/v1' "
                                                          "(drop '/v1'"),
        ({"engines": [{"url": "http://ops:secret@127.0.0.1:9"}]}, "carries credentials"),
        ({"engines": [{"url": "http://127.0.0.1:9"}, {"url": "http://localhost:9",
                                                       "name": "b", "kv_topic": "b"}]},
         "are one engine"),
        ({"engines": [{"url": "http://127.0.0.1:9", "name": "a", "kv_topic": "a"},
                      {"url": "http://127.0.0.1:9", "name": "b", "kv_topic": "b"}]},
         "are one engine"),
        ({"index": {"redis_url": "redis://127.0.0.1:6379/0"}}, "add `backend: redis`"),
        ({"workflows": {"redis_url": "redis://127.0.0.1:6379/0"}}, "add `store: redis`"),
        ({"tracing": {"endpoint": "http://127.0.0.1:4318"}}, "add otlp-http or otlp-grpc"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(problem)):
            parse_config({"engines": engines, **bad})
    assert parse_config({"engines": engines, "tracing": {
        "exporter": "otlp-http", "endpoint": "http://127.0.0.1:4318"}}).tracing.endpoint


def test_a_bind_beyond_this_machine_is_said_at_start_up() -> None:
    engines = [{"url": "http://127.0.0.1:9"}]
    assert exposure_warnings(parse_config({"engines": engines})) == []
    assert exposure_warnings(parse_config({"engines": engines, "host": "::1"})) == []
    open_ = exposure_warnings(parse_config({"engines": engines, "host": "0.0.0.0",
                                            "kv_events_bind": "tcp://0.0.0.0:5557"}))
    assert len(open_) == 2 and "with no tenants configured" in open_[0]
    assert "KV events are taken from anyone" in open_[1]
    tenants = {"a": {"keys": ["sk-tenant-a-0123456789"]}}
    assert exposure_warnings(parse_config({"engines": engines, "host": "0.0.0.0",
                                           "tenants": tenants})) == []


def test_config_defaults_bind_to_loopback() -> None:
    config = parse_config({"engines": [{"url": "http://127.0.0.1:9"}]})
    assert config.host == "127.0.0.1"
    assert config.engines[0].engine_name == "127.0.0.1:9"


def test_config_rejects_duplicate_engine_names() -> None:
    with pytest.raises(ConfigError, match="unique"):
        parse_config({"engines": [{"url": "http://127.0.0.1:9", "name": "x"},
                                  {"url": "http://127.0.0.1:10", "name": "x"}]})


def test_engine_load_is_read_from_vllm_metrics_text() -> None:
    text = (
        '# TYPE vllm:num_requests_running gauge\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        '# TYPE vllm:num_requests_waiting gauge\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
        '# TYPE vllm:kv_cache_usage_perc gauge\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        '# TYPE vllm:prefix_cache_hits counter\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 64.0\n'
    )
    load = parse_engine_load(text)
    assert (load.num_running, load.num_waiting, load.kv_usage) == (5, 4, 0.25)
    assert load.prefix_cache_hits == 64.0
    with pytest.raises(MetricsParseError):
        parse_engine_load("up 1\n")


def test_engine_load_reads_only_its_metrics_by_exact_name() -> None:
    text = (
        '# TYPE vllm:num_requests_waiting_by_reason gauge\n'
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 7.0\n'
        'vllm:num_requests_running{engine="0"} 1.0\n'
        'vllm:num_requests_waiting{engine="0"} 2.0\n'
        'vllm:e2e_request_latency_seconds_bucket{le="+Inf"} 9.0\n'
        'process_start_time_seconds 12.5\n'
    )
    load = parse_engine_load(text)
    assert (load.num_running, load.num_waiting, load.process_start_time) == (1, 2, 12.5)


def test_every_shipped_config_validates() -> None:
    from pathlib import Path

    from gateway.config import load_config

    configs = sorted(Path(__file__).parent.parent.joinpath("configs").glob("*.yaml"))
    assert len(configs) >= 3
    for path in configs:
        assert load_config(path).engines


def test_kvgate_policy_learns_engine_speed_from_observed_ttft_and_itl() -> None:
    from planner.policies.kvgate import KvgatePolicy

    policy = KvgatePolicy()
    req = RouteRequest(request_id="r1", model="m", prompt_tokens=4000, max_tokens=100)
    placement = policy.choose(req, [engine("a")], 0.0)
    assert placement.cost is not None and placement.engine == "a"
    predicted_ttft = placement.cost.ttft_s
    policy.on_dispatch(req, placement, 10.0)
    # The engine is twice as slow as its profile in prefill and three times in decode.
    policy.on_first_token("r1", "a", 10.0 + 2 * predicted_ttft)
    itl = placement.cost.decode_s / 100
    policy.on_finish("r1", "a", 10.0 + 2 * predicted_ttft + 3 * itl * 99, output_tokens=100)
    assert 1.0 < policy.cost.correction.prefill["a"] < 2.0
    assert 1.0 < policy.cost.correction.decode["a"] < 3.0


def test_streamed_output_events_are_counted_from_vllm_sse() -> None:
    from gateway.proxy import _token_events

    chat = (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
            b'data: {"choices":[{"index":0,"delta":{"content":" hi"}}]}\n\n'
            b'data: {"choices":[{"index":0,"delta":{"content":" there"}}]}\n\n'
            b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\ndata: [DONE]\n\n')
    completion = b'data: {"choices":[{"index":0,"text":" a"}]}\n\n'
    assert _token_events(chat) == 2
    assert _token_events(completion) == 1


def test_an_engine_name_may_hold_anything_but_a_control_character() -> None:
    from gateway.config import ConfigError, parse_config

    # It goes into every answer's x-kvgate-engine header: a line break made each call a 500.
    for name in ("gpu 0", "节点1", "a" * 256):
        parse_config({"engines": [{"url": "http://127.0.0.1:9", "name": name}]})
    for name in ("", "bad\r\nX-Injected: 1", "tab\there", "a" * 257):
        with pytest.raises(ConfigError, match="engine name"):
            parse_config({"engines": [{"url": "http://127.0.0.1:9", "name": name}]})
