"""Gateway configuration: declarative YAML validated by pydantic, errors naming the bad key."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from planner.policy import POLICIES


class ConfigError(ValueError):
    """A config file or option that cannot be used; the message names the key and the problem."""


class EngineEntry(BaseModel):
    """One upstream engine (a vLLM server or a `kvgate sim`)."""

    model_config = ConfigDict(extra="forbid")

    url: str
    name: str | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        parsed = urlparse(v)
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.port is None:
            raise ValueError(f"engine url must look like http://HOST:PORT, got {v!r}")
        return v.rstrip("/")

    @property
    def engine_name(self) -> str:
        """The name used in logs, metrics and the `x-kvgate-engine` header."""
        return self.name or urlparse(self.url).netloc


class GatewayConfig(BaseModel):
    """Everything `kvgate serve` needs."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    engines: list[EngineEntry] = Field(min_length=1)
    policy: str = "least-loaded"
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    scrape_interval_s: float = Field(default=0.5, gt=0)
    health_interval_s: float = Field(default=1.0, gt=0)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    request_timeout_s: float = Field(default=600.0, gt=0)
    retries: int = Field(default=2, ge=0)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"unknown policy {v!r}; known: {', '.join(sorted(POLICIES))}")
        return v

    @model_validator(mode="after")
    def _unique_engine_names(self) -> GatewayConfig:
        names = [e.engine_name for e in self.engines]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"engine names must be unique, repeated: {', '.join(dupes)}")
        return self


def _format(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"{source}: {loc}: {e['msg']}")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "config") -> GatewayConfig:
    """Validate a mapping; ConfigError lists every bad key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(e, source)) from None


def load_config(path: str | Path, **overrides: Any) -> GatewayConfig:
    """Read a YAML file and apply command-line overrides (None values are ignored)."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if isinstance(data, dict):
        data.update({k: v for k, v in overrides.items() if v is not None})
    return parse_config(data, str(p))
