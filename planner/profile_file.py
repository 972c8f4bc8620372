"""EngineProfile as YAML: every field by name, validated, errors naming the bad key.

A file either lists all fields or names a built-in profile as `base:` and overrides some of them.
`calibration:` is free-form metadata (what `kvgate calibrate` measured and its fit residuals); it
does not change the profile.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import yaml

from planner.documents import load_yaml
from planner.profiles import EngineProfile, get_profile

_TYPES: dict[str, type] = {"str": str, "int": int, "float": float, "float | None": float}
# The dataclass's annotations are strings (postponed evaluation): map them to the types they name.
FIELDS: dict[str, type] = {f.name: _TYPES[str(f.type)] for f in dataclasses.fields(EngineProfile)}
OPTIONAL = tuple(f.name for f in dataclasses.fields(EngineProfile) if "None" in str(f.type))
"""Fields that may be null (the profile then uses what None stands for)."""
META_KEYS = ("base", "calibration")
# Efficiencies are at most 1; overheads may be zero; everything else numeric must be > 0.
AT_MOST_ONE = ("mfu", "mbu", "attention_mfu")
MAY_BE_ZERO = ("step_overhead_s", "request_overhead_s", "chat_overhead_s", "seq_overhead_s",
               "request_overhead_per_token_s", "api_servers", "long_prefill_token_threshold")


MAX_STEP_S = 3600.0
"""The longest engine step a profile may imply: no GPU takes an hour per step."""
MAX_KV_BLOCKS = 100_000_000
"""The most KV blocks of 16 tokens a profile's cache may hold (1.6 billion tokens)."""


class ProfileFileError(ValueError):
    """A profile file that cannot be used; the message names the file, the key and the problem."""


def _number_text(text: str) -> str | float:
    """A number YAML 1.1 left as text, as a float: `9.89e17` (PyYAML reads an exponent as a
    number only with a dot and a sign, `9.89e+17`). Other text, and non-finite numbers, stay
    text, so the caller names them."""
    try:
        number = float(text)
    except ValueError:
        return text
    return number if math.isfinite(number) else text


def _check_value(key: str, value: Any, source: str) -> Any:
    want = FIELDS[key]
    if value is None and key in OPTIONAL:
        return None
    if want is str:
        if not isinstance(value, str) or not value:
            raise ProfileFileError(f"{source}: {key}: expected a non-empty string, got {value!r}")
        return value
    if isinstance(value, str):
        value = _number_text(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileFileError(f"{source}: {key}: expected a number, got {value!r}")
    if not math.isfinite(value):  # YAML's .inf and .nan
        raise ProfileFileError(f"{source}: {key}: expected a finite number, got {value!r}")
    if want is int and value != int(value):
        raise ProfileFileError(f"{source}: {key}: expected an integer, got {value!r}")
    number: float = int(value) if want is int else float(value)
    if key in MAY_BE_ZERO:
        if number < 0:
            raise ProfileFileError(f"{source}: {key}: must be >= 0, got {value!r}")
    elif number <= 0:
        raise ProfileFileError(f"{source}: {key}: must be > 0, got {value!r}")
    if key in AT_MOST_ONE and number > 1:
        raise ProfileFileError(f"{source}: {key}: an efficiency must be <= 1, got {value!r}")
    return number


def parse_profile(data: Any, source: str = "profile") -> EngineProfile:
    """Validate a mapping into an EngineProfile; ProfileFileError names the bad key."""
    if not isinstance(data, dict):
        raise ProfileFileError(f"{source}: expected a mapping of profile fields at the top level")
    unknown = sorted(str(k) for k in data if k not in FIELDS and k not in META_KEYS)
    if unknown:
        raise ProfileFileError(f"{source}: unknown key(s) {', '.join(unknown)}; known: "
                               f"{', '.join([*FIELDS, *META_KEYS])}")
    values: dict[str, Any] = {}
    base = data.get("base")
    if base is not None:
        try:
            values = dataclasses.asdict(get_profile(str(base)))
        except ValueError as e:
            raise ProfileFileError(f"{source}: base: {e}") from None
    if "calibration" in data and not isinstance(data["calibration"], dict):
        raise ProfileFileError(f"{source}: calibration: expected a mapping")
    for key in FIELDS:
        if key in data:
            values[key] = _check_value(key, data[key], source)
    defaults = {f.name for f in dataclasses.fields(EngineProfile)
                if f.default is not dataclasses.MISSING}
    missing = [k for k in FIELDS if k not in values and k not in defaults]
    if missing:
        raise ProfileFileError(f"{source}: missing key(s) {', '.join(missing)} "
                               f"(or name a built-in profile as base:)")
    profile = EngineProfile(**values)
    # Numbers each valid alone can still describe no engine (TFLOPS typed for FLOP/s): a run
    # on them would take a virtual age per step, or a cache of more blocks than memory holds.
    step = max(profile.decode_step_time(1, 0),
               profile.prefill_time(profile.max_num_batched_tokens))
    if not step < MAX_STEP_S:
        raise ProfileFileError(f"{source}: one engine step would take {step:.3g} s (a full "
                               f"prefill step or one decode step); check the units of "
                               f"peak_flops, mem_bandwidth and params (at most {MAX_STEP_S:g} s)")
    blocks = profile.kv_cache_bytes / (profile.kv_bytes_per_token * 16)
    if not blocks <= MAX_KV_BLOCKS:
        raise ProfileFileError(f"{source}: kv_cache_bytes holds {blocks:.3g} blocks of 16 "
                               f"tokens; at most {MAX_KV_BLOCKS:,} are modelled")
    return profile


def load_profile_file(path: str | Path) -> EngineProfile:
    """Read and validate a profile YAML file."""
    p = Path(path)
    try:
        data = load_yaml(p.read_text())
    except FileNotFoundError:
        raise ProfileFileError(f"{p}: no such profile file") from None
    except (OSError, UnicodeDecodeError) as e:  # a directory, no permission, not text
        raise ProfileFileError(f"{p}: cannot read it as a profile file: "
                               f"{e.strerror if isinstance(e, OSError) else e}") from None
    except yaml.YAMLError as e:
        raise ProfileFileError(f"{p}: not valid YAML: {e}") from None
    return parse_profile(data, str(p))


def profile_to_yaml(profile: EngineProfile, calibration: dict[str, Any] | None = None) -> str:
    """The YAML text of `profile` (every field), with optional calibration metadata."""
    data: dict[str, Any] = dataclasses.asdict(profile)
    if calibration is not None:
        data["calibration"] = calibration
    text: str = yaml.safe_dump(data, sort_keys=False)
    return text
