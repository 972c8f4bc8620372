"""Profile files: the YAML form of an EngineProfile and where kvgate accepts one."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.config import ConfigError, load_config
from kvgate.bench.options import BenchOptions
from kvgate.bench.runner import check_options
from kvgate.bench.workloads import WorkloadError
from planner.profile_file import ProfileFileError, load_profile_file, parse_profile, profile_to_yaml
from planner.profiles import PROFILES, EngineProfile


def write(tmp_path: Path, data: object, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_round_trip_keeps_every_field() -> None:
    profile = PROFILES["cpu-tiny"]
    assert parse_profile(yaml.safe_load(profile_to_yaml(profile))) == profile


def test_calibration_metadata_is_accepted_and_ignored() -> None:
    profile = PROFILES["cpu-tiny"]
    text = profile_to_yaml(profile, {"rms_residual_s": 0.001})
    assert parse_profile(yaml.safe_load(text)) == profile


def test_base_profile_with_overrides() -> None:
    p = parse_profile({"base": "cpu-tiny", "name": "fitted", "step_overhead_s": 0.003})
    assert p == dataclasses.replace(PROFILES["cpu-tiny"], name="fitted", step_overhead_s=0.003)


def test_unknown_key_is_named() -> None:
    with pytest.raises(ProfileFileError, match=r"unknown key.*step_overhead\b"):
        parse_profile({"base": "cpu-tiny", "step_overhead": 0.1})


def test_a_key_given_twice_is_named(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("base: cpu-tiny\npeak_flops: 1.0e15\nlayers: 4\npeak_flops: 2.0e15\n")
    with pytest.raises(ProfileFileError, match=r"key 'peak_flops' is given twice \(lines 2 and 4"):
        load_profile_file(path)


def test_missing_keys_are_named_without_base() -> None:
    data = dataclasses.asdict(PROFILES["cpu-tiny"])
    del data["mbu"]
    with pytest.raises(ProfileFileError, match=r"missing key.*mbu"):
        parse_profile(data)


@pytest.mark.parametrize(("key", "value", "problem"), [
    ("layers", 2.5, "layers: expected an integer"),
    ("mfu", 1.5, "mfu: an efficiency must be <= 1"),
    ("peak_flops", 0, "peak_flops: must be > 0"),
    ("step_overhead_s", -0.1, "step_overhead_s: must be >= 0"),
    ("params", "many", "params: expected a number"),
    ("model", "", "model: expected a non-empty string"),
    ("layers", float("inf"), "layers: expected a finite number, got inf"),
    ("mfu", float("nan"), "mfu: expected a finite number, got nan"),
    ("kv_cache_bytes", float("inf"), "kv_cache_bytes: expected a finite number"),
])
def test_bad_value_is_named(key: str, value: object, problem: str) -> None:
    with pytest.raises(ProfileFileError, match=problem):
        parse_profile({"base": "cpu-tiny", key: value})


def test_exponent_written_without_a_dot_is_a_number() -> None:
    # PyYAML (YAML 1.1) loads `9.89e17` as text; the profile reads it as the number it means.
    data = yaml.safe_load("base: cpu-tiny\npeak_flops: 9.89e17\nlayers: 4\n")
    assert data["peak_flops"] == "9.89e17"
    p = parse_profile(data)
    assert p.peak_flops == 9.89e17 and p.layers == 4
    with pytest.raises(ProfileFileError, match="peak_flops: expected a number, got 'inf'"):
        parse_profile({"base": "cpu-tiny", "peak_flops": "inf"})
    with pytest.raises(ProfileFileError, match="layers: expected an integer"):
        parse_profile({"base": "cpu-tiny", "layers": "2.5e0"})


def test_unknown_base_lists_known_profiles() -> None:
    with pytest.raises(ProfileFileError, match=r"base: unknown engine profile.*cpu-tiny"):
        parse_profile({"base": "tpu-giant"})


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ProfileFileError, match="no such profile file"):
        load_profile_file(tmp_path / "absent.yaml")


def test_gateway_engine_uses_profile_file_relative_to_config(tmp_path: Path) -> None:
    write(tmp_path, {"base": "cpu-tiny", "name": "fitted", "step_overhead_s": 0.004}, "fit.yaml")
    cfg = write(tmp_path, {"engines": [{"url": "http://127.0.0.1:9001", "profile_file": "fit.yaml"},
                                       {"url": "http://127.0.0.1:9002", "profile": "cpu-tiny"}]},
                "gw.yaml")
    config = load_config(cfg)
    assert config.engines[0].engine_profile.step_overhead_s == 0.004
    assert config.engines[1].engine_profile == PROFILES["cpu-tiny"]


def test_gateway_config_names_bad_profile_file(tmp_path: Path) -> None:
    write(tmp_path, {"base": "cpu-tiny", "mbu": 2}, "fit.yaml")
    cfg = write(tmp_path, {"engines": [{"url": "http://127.0.0.1:9001",
                                        "profile_file": "fit.yaml"}]}, "gw.yaml")
    with pytest.raises(ConfigError, match=r"engines.0.*profile_file.*mbu"):
        load_config(cfg)


def test_bench_rejects_bad_profile_file(tmp_path: Path) -> None:
    path = write(tmp_path, {"base": "cpu-tiny", "layers": 0})
    with pytest.raises(WorkloadError, match="layers: must be > 0"):
        check_options(BenchOptions(workload="fanout", profile_file=str(path)))


def test_bench_runs_with_profile_file(tmp_path: Path) -> None:
    path = write(tmp_path, {"base": "cpu-tiny", "name": "fitted-tiny"})
    out = tmp_path / "r.json"
    run = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "bench", "--workload", "fanout", "--engines", "2",
         "--workflows", "2", "--policy", "kvgate", "--profile-file", str(path), "--json",
         str(out), "--no-progress"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert yaml.safe_load(out.read_text())["profile"] == "fitted-tiny"


def test_sim_cli_rejects_bad_profile_file_with_exit_2(tmp_path: Path) -> None:
    path = write(tmp_path, {"base": "cpu-tiny", "colour": "blue"})
    run = subprocess.run([sys.executable, "-m", "kvgate.cli", "sim", "--port", "1",
                          "--profile-file", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2
    assert "unknown key(s) colour" in run.stderr


@pytest.mark.parametrize("name", ["cpu-tiny", "cpu-tiny-avx2"])
def test_shipped_cpu_tiny_files_match_the_built_in_profiles(name: str) -> None:
    shipped = Path(__file__).resolve().parent.parent / "configs" / "profiles" / f"{name}.yaml"
    assert load_profile_file(shipped) == PROFILES[name]


def shipped_what_if(base_name: str, what: str) -> tuple[EngineProfile, EngineProfile]:
    """The what-if profile `configs/profiles/{base_name}-{what}.yaml`, and its base."""
    path = (Path(__file__).resolve().parent.parent
            / f"configs/profiles/{base_name}-{what}.yaml")
    return load_profile_file(path), PROFILES[base_name]


@pytest.mark.parametrize("base_name", ["h100-llama3-8b", "h100x4-llama3-70b"])
def test_free_prefill_what_ifs_differ_from_their_base_only_in_compute(base_name: str) -> None:
    # configs/profiles/*-free-prefill.yaml back the README's goodput ceilings: the same engine
    # in every way but the compute rate.
    p, base = shipped_what_if(base_name, "free-prefill")
    assert p.name == f"{base_name}-free-prefill"
    assert p.peak_flops == pytest.approx(1000 * base.peak_flops)
    assert dataclasses.replace(p, name=base.name, peak_flops=base.peak_flops) == base


@pytest.mark.parametrize("base_name", ["h100-llama3-8b", "h100x4-llama3-70b"])
def test_request_latency_what_ifs_differ_from_their_base_only_in_it(base_name: str) -> None:
    # configs/profiles/*-request-latency.yaml back the README's request-latency what-if.
    p, base = shipped_what_if(base_name, "request-latency")
    assert p.name == f"{base_name}-request-latency"
    assert p.request_overhead_s == pytest.approx(0.002) and base.request_overhead_s == 0.0
    assert dataclasses.replace(p, name=base.name, request_overhead_s=0.0) == base


@pytest.mark.parametrize("base_name", ["h100-llama3-8b", "h100x4-llama3-70b"])
def test_api_server_what_ifs_differ_from_their_base_only_in_the_server(base_name: str) -> None:
    # configs/profiles/*-api-server.yaml back the README's API-server what-if: the server cost
    # `kvgate microbench server-cost` measured on a real vLLM, one server process.
    p, base = shipped_what_if(base_name, "api-server")
    assert p.name == f"{base_name}-api-server"
    assert p.api_servers == 1 and base.api_servers == 0
    assert p.request_overhead_per_token_s > 0 and base.request_overhead_per_token_s == 0.0
    assert p.server_latency(False, 32_000) > p.server_latency(False, 0) > 0
    assert dataclasses.replace(p, name=base.name, request_overhead_s=0.0,
                               request_overhead_per_token_s=0.0, api_servers=0) == base


def test_server_fields_may_be_zero_but_not_negative() -> None:
    assert parse_profile({"base": "cpu-tiny", "api_servers": 0,
                          "request_overhead_per_token_s": 0}).api_servers == 0
    assert parse_profile({"base": "cpu-tiny",
                          "long_prefill_token_threshold": 512}).long_prefill_token_threshold == 512
    with pytest.raises(ProfileFileError, match="request_overhead_per_token_s: must be >= 0"):
        parse_profile({"base": "cpu-tiny", "request_overhead_per_token_s": -1e-6})
    with pytest.raises(ProfileFileError, match="api_servers: expected an integer"):
        parse_profile({"base": "cpu-tiny", "api_servers": 1.5})


def test_the_four_server_what_if_differs_from_the_one_server_one_in_that_alone() -> None:
    four, _ = shipped_what_if("h100x4-llama3-70b", "api-servers-4")
    one, _ = shipped_what_if("h100x4-llama3-70b", "api-server")
    assert four.api_servers == 4
    assert dataclasses.replace(four, name=one.name, api_servers=1) == one


@pytest.mark.parametrize(("changes", "problem"), [
    # TFLOPS typed where FLOP/s go: each step an age of virtual time (the run hung).
    ({"peak_flops": 989}, "one engine step would take"),
    ({"mem_bandwidth": 1e-300}, "one engine step would take"),
    # A cache of more blocks than any memory holds (the run grew without end).
    ({"kv_cache_bytes": 1.0e18}, "at most 100,000,000 are modelled"),
])
def test_numbers_that_describe_no_engine_are_refused(changes: dict[str, float],
                                                     problem: str) -> None:
    with pytest.raises(ProfileFileError, match=problem):
        parse_profile({"base": "h100-llama3-8b", **changes}, "typo.yaml")
