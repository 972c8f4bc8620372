"""Gateway configuration: declarative YAML validated by pydantic, errors naming the bad key."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin
from urllib.parse import urlparse

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from planner.core import planner_names
from planner.documents import load_yaml
from planner.hints import PRIORITY_LIMIT
from planner.profile_file import ProfileFileError, load_profile_file
from planner.profiles import DEFAULT_PROFILE, PROFILES, EngineProfile, get_profile
from planner.transfer import TransferLink, parse_link


class ConfigError(ValueError):
    """A config file or option that cannot be used; the message names the key and the problem."""


def check_zmq_endpoint(v: str | None) -> str | None:
    """`tcp://HOST:PORT` or `ipc://PATH`; anything else is rejected with the reason."""
    if v is None:
        return v
    if v.startswith("ipc://") and len(v) > len("ipc://"):
        return v
    if v.startswith("tcp://"):
        host, _, port = v[len("tcp://"):].rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return v
    raise ValueError(f"ZMQ endpoint must look like tcp://HOST:PORT or ipc://PATH, got {v!r}")


def engine_url_problem(url: str) -> str | None:
    """Why `url` is no engine's address (None when it is one): http(s)://HOST:PORT, nothing
    more. The gateway adds `/health`, `/metrics` and `/v1/...` itself, so an OpenAI-style base
    URL (`.../v1`) would have every health check miss; credentials in it would be shown in
    `/health`, headers and metrics (the engine's key goes in `engine_api_key`)."""
    try:
        parsed = urlparse(url)
        port = parsed.port
    except ValueError:  # a port that is no number or out of range
        port = None
    else:
        if parsed.scheme in ("http", "https") and parsed.hostname and port is not None:
            if parsed.username is not None or parsed.password is not None:
                return (f"engine url {url!r} carries credentials: give the engine's key as "
                        "engine_api_key instead")
            if parsed.path.strip("/") or parsed.query or parsed.fragment:
                return (f"engine url must be http://HOST:PORT with no path, got {url!r} "
                        f"(drop {url[url.index(parsed.netloc) + len(parsed.netloc):]!r}: the "
                        "gateway adds /v1/... itself)")
            return None
    return f"engine url must look like http://HOST:PORT, got {url!r}"


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def engine_address(url: str) -> tuple[str, str, int]:
    """An engine URL's scheme, host and port, with the loopback names made one: two entries
    with the same address are the same engine."""
    parsed = urlparse(url)
    host = (parsed.hostname or "").lower()
    return parsed.scheme, "loopback" if host in LOOPBACK_NAMES else host, parsed.port or 0


def check_redis_url(url: str | None) -> None:
    """A URL redis-py can connect with, or ValueError saying what one looks like."""
    if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"redis_url must start with redis://, rediss:// or unix:// (e.g. "
                         f"redis://127.0.0.1:6379/0), got {url!r}")


def _takes_bool(annotation: Any) -> bool:
    return annotation is bool or any(_takes_bool(a) for a in get_args(annotation))


class _Section(BaseModel):
    """A config section: unknown keys refused, and `true`/`false` never read as a number
    (pydantic's lax mode took `port: yes` as port 1 and `retries: false` as 0)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and not _takes_bool(field.annotation):
                raise ValueError(f"expected {_kind(field.annotation)}, not {str(v).lower()}")
        return v


def _kind(annotation: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string"}
    for a in (annotation, *get_args(annotation)):
        if a in names:
            return names[a]
    return "a value of another type"


class EngineEntry(_Section):
    """One upstream engine (a vLLM server or a `kvgate sim`)."""
    _profile: EngineProfile | None = PrivateAttr(default=None)

    url: str
    name: str | None = None
    profile: str = DEFAULT_PROFILE
    """Roofline profile the cost model uses for this engine."""
    profile_file: str | None = None
    """A profile YAML (e.g. from `kvgate calibrate`) that replaces `profile` for the cost model."""
    kv_events: str | None = None
    """Connect mode: the engine's bound PUB endpoint (e.g. tcp://10.0.0.5:5557)."""
    kv_replay: str | None = None
    """The engine's replay ROUTER endpoint, used to recover missed events."""
    kv_topic: str | None = None
    """Topic of the engine's KV events (default: its URL, which `kvgate sim` uses by default)."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """The engine's `--scheduling-policy`: with `priority`, a planner that ranks calls sends
    each request vLLM's `priority` field (lower runs first)."""
    scheduler: Literal["vllm", "kvgate-pace"] = "vllm"
    """The engine's scheduler: `kvgate-pace` when it runs kvgate's pacing plugin
    (`--scheduler-cls kvgate_pace.KvgatePaceAsyncScheduler`); a pacing policy (`kvgate`) then
    sends it a long prompt once with a per-step cap instead of in pieces."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        problem = engine_url_problem(v)
        if problem:
            raise ValueError(problem)
        return v.rstrip("/")

    @field_validator("name")
    @classmethod
    def _header_safe_name(cls, v: str | None) -> str | None:
        # It goes into the `x-kvgate-engine` header of every answer, metrics labels and logs:
        # a line break in it made every call placed there a 500.
        if v is not None and not ENGINE_NAME.fullmatch(v):
            raise ValueError(f"engine name {v!r}: 1 to 256 characters, none of them a "
                             "control character (it goes into a response header)")
        return v

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, v: str) -> str:
        if v not in PROFILES:
            raise ValueError(f"unknown profile {v!r}; known: {', '.join(sorted(PROFILES))}")
        return v

    @model_validator(mode="after")
    def _readable_profile_file(self) -> EngineEntry:
        if self.profile_file is not None:
            try:
                self._profile = load_profile_file(self.profile_file)
            except ProfileFileError as e:
                raise ValueError(f"profile_file: {e}") from None
        return self

    @property
    def engine_profile(self) -> EngineProfile:
        """The profile the cost model uses: the loaded profile_file, else the named profile."""
        return self._profile if self._profile is not None else get_profile(self.profile)

    @field_validator("kv_events", "kv_replay")
    @classmethod
    def _zmq_endpoint(cls, v: str | None) -> str | None:
        return check_zmq_endpoint(v)

    @property
    def engine_name(self) -> str:
        """The name used in logs, metrics and the `x-kvgate-engine` header."""
        return self.name or urlparse(self.url).netloc

    @property
    def topic(self) -> str:
        """The KV-event topic that identifies this engine."""
        return self.kv_topic if self.kv_topic is not None else self.url


class IndexSettings(_Section):
    """The global KV index."""

    backend: Literal["memory", "redis"] = "memory"
    redis_url: str | None = None
    namespace: str = "kvgate"
    block_size: int = Field(default=16, gt=0)
    """Tokens per index block (may differ from engines' block sizes)."""
    speculative_ttl_s: float = Field(default=2.0, ge=0)
    """How long a routed-but-unconfirmed prefix counts as held by the engine it was sent to."""

    @model_validator(mode="after")
    def _redis_needs_url(self) -> IndexSettings:
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("backend 'redis' needs redis_url (e.g. redis://127.0.0.1:6379/0)")
        check_redis_url(self.redis_url)
        return self


class WorkflowSettings(_Section):
    """The workflow API (`/v1/workflows`) and where workflow state lives."""

    store: Literal["memory", "redis"] = "memory"
    """`redis` lets replicas sharing the Redis read (and follow, and cancel) each other's
    workflows."""
    redis_url: str | None = None
    namespace: str = "kvgate"
    ttl_s: float = Field(default=3600.0, gt=0)
    """How long a workflow stays readable once it is over (for hint-mode workflows: since
    their last call)."""
    max_tasks: int = Field(default=1000, gt=0)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    replica: str | None = None
    """This gateway's name in workflow snapshots (default: HOSTNAME:PORT)."""
    lease_s: float = Field(default=10.0, gt=0)
    """With a shared store (`redis`): a replica renews its lease on each workflow it drives
    every third of this; a workflow whose lease lapses (its replica died) or is given up (its
    replica stopped) is taken over by another replica, which goes on from the tasks done."""

    @model_validator(mode="after")
    def _redis_needs_url(self) -> WorkflowSettings:
        if self.store == "redis" and not self.redis_url:
            raise ValueError("store 'redis' needs redis_url (e.g. redis://127.0.0.1:6379/0)")
        check_redis_url(self.redis_url)
        return self


class KvTransferSettings(_Section):
    """How the gateway may move KV between engines (ARCHITECTURE.md, capability 5)."""

    link: str = "none"
    """`nvlink`, `rdma`, a bandwidth in GB/s, or `none`: without a link the planner moves KV
    by recompute warm-ups only. With one, every engine must run a KV connector (vLLM's
    NixlConnector, `kv_role` `kv_both`) so the two-leg transfer works."""

    @field_validator("link")
    @classmethod
    def _known_link(cls, v: str) -> str:
        parse_link(v)
        return v

    def transfer_link(self) -> TransferLink:
        """The link, parsed."""
        return parse_link(self.link)


TraceExporter = Literal["memory", "console", "otlp-http", "otlp-grpc", "none"]
TRACE_EXPORTERS = ("memory", "console", "otlp-http", "otlp-grpc", "none")
"""Where spans go (gateway/tracing.py): the gateway's own store (served at /v1/traces), stdout,
an OTLP receiver over HTTP or gRPC, or nowhere (tracing off)."""


def _memory_only() -> list[TraceExporter]:
    return ["memory"]


class TracingSettings(_Section):
    """Traces of workflows and calls (OpenTelemetry), and where they are exported."""

    exporter: list[TraceExporter] = Field(default_factory=_memory_only)
    """One name or a list; `none` turns tracing off."""
    endpoint: str | None = None
    """The OTLP receiver: for `otlp-http` a URL (a bare `http://HOST:PORT` gets `/v1/traces`;
    default http://127.0.0.1:4318/v1/traces), for `otlp-grpc` `http://HOST:PORT` (plaintext) or
    `https://HOST:PORT` (default http://127.0.0.1:4317)."""
    headers: dict[str, str] = Field(default_factory=dict)
    """Sent with every OTLP export (e.g. an API key the collector wants)."""
    service_name: str = Field(default="kvgate", min_length=1)
    max_traces: int = Field(default=1000, gt=0)
    """Traces the memory store keeps; the least recently active go first."""
    max_spans_per_trace: int = Field(default=10_000, gt=0)
    """Spans the memory store keeps per trace (a long hint-mode workflow stops growing)."""
    max_spans: int = Field(default=200_000, gt=0)
    """Spans the memory store keeps in all (about 1.2 KB each): past it the least recently
    active traces go first. Without it the two limits above allowed ten million spans, about
    12 GB."""
    batch_delay_s: float = Field(default=1.0, gt=0)
    """How long OTLP and console exporters gather spans before a send."""

    @field_validator("exporter", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    @field_validator("exporter")
    @classmethod
    def _sensible_exporters(cls, v: list[TraceExporter]) -> list[TraceExporter]:
        names = list(dict.fromkeys(v))
        if not names:
            raise ValueError(f"name at least one exporter ({', '.join(TRACE_EXPORTERS)})")
        if "none" in names and len(names) > 1:
            raise ValueError("'none' turns tracing off and cannot be combined with exporters")
        if "otlp-http" in names and "otlp-grpc" in names:
            raise ValueError("choose one of otlp-http and otlp-grpc (one endpoint is configured)")
        return names

    @field_validator("endpoint")
    @classmethod
    def _endpoint_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parsed = urlparse(v)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"OTLP endpoint must look like http://HOST:PORT[/PATH], got {v!r}")
        return v

    @property
    def enabled(self) -> bool:
        """Spans are recorded at all."""
        return self.exporter != ["none"]


MIN_KEY_CHARS = 16
PLACEHOLDER_KEYS = frozenset({"replace-with-a-long-random-key", "change-me-to-a-secret-key"})
"""Example values of the shipped configs: a gateway started with one would serve /admin to
anyone who has read them."""
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ENGINE_NAME = re.compile(r"[^\x00-\x1f\x7f]{1,256}")
"""An engine's name: no control characters (it is a header value and a label)."""


class TenantEntry(_Section):
    """One tenant: the API keys its clients send, and whom it shares cached prefixes with."""

    keys: list[str] = Field(min_length=1)
    """`Authorization: Bearer KEY` values that stand for this tenant (at least 16 characters)."""
    prefix_group: str | None = None
    """Tenants with the same group share cached prefixes (one `cache_salt`); by default a
    tenant shares with nobody."""
    priority_floor: int = Field(default=0, ge=-PRIORITY_LIMIT, le=PRIORITY_LIMIT)
    """The most urgent explicit priority its calls may ask (vLLM's convention, lower first:
    `X-KVGate-Priority`, `kvgate.priority`, `nvext.agent_hints.priority`, a task's `priority`,
    and vLLM's own body `priority`); a call asking for more is raised to it. By default 0:
    a tenant may put its own calls behind others, not ahead of them."""
    min_deadline_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """The shortest deadline (`deadline_s`, `X-KVGate-Deadline`, a workflow's `deadline_s`)
    its calls are ranked by; a shorter one is raised to it. By default (unset) a tenant's
    deadlines rank nothing: a deadline of a millisecond would put every call of its ahead
    of every other tenant's."""

    @field_validator("prefix_group")
    @classmethod
    def _group_name(cls, v: str | None) -> str | None:
        # It ends up in every call's `cache_salt`, which vLLM refuses with a `/`, `@`, `\`
        # or NUL in it or past 128 characters.
        if v is not None and not TENANT_NAME.fullmatch(v):
            raise ValueError(f"prefix_group {v!r}: letters, digits and . _ - (at most 64, "
                             "starting with a letter or digit)")
        return v

    @field_validator("keys")
    @classmethod
    def _long_keys(cls, v: list[str]) -> list[str]:
        for key in v:
            if len(key) < MIN_KEY_CHARS or not key.isascii() or key != key.strip():
                raise ValueError(f"a tenant key must be at least {MIN_KEY_CHARS} ASCII "
                                 "characters without surrounding spaces")
        return v


class GatewayConfig(_Section):
    """Everything `kvgate serve` needs."""

    host: str = Field(default="127.0.0.1", min_length=1)
    """The address to listen on; an empty one would listen on every interface."""
    port: int = Field(default=8000, ge=1, le=65535)
    engines: list[EngineEntry] = Field(min_length=1)
    policy: str = "kvgate"
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    scrape_interval_s: float = Field(default=0.5, gt=0)
    health_interval_s: float = Field(default=1.0, gt=0)
    health_failure_threshold: int = Field(default=3, ge=1)
    """Consecutive failed health checks (timeouts, error statuses) before an engine leaves
    rotation; a refused connection takes it out at once."""
    connect_timeout_s: float = Field(default=5.0, gt=0)
    request_timeout_s: float = Field(default=600.0, gt=0)
    client_write_timeout_s: float = Field(default=60.0, gt=0)
    """A client that takes none of its answer for this long (it stopped reading, or vanished
    without closing) is dropped: the engine's call is aborted and its place freed."""
    retries: int = Field(default=2, ge=0)
    kv_events_bind: str | None = None
    """Bind mode: one SUB socket engines connect to, e.g. tcp://127.0.0.1:5557."""
    index: IndexSettings = Field(default_factory=IndexSettings)
    kv_transfer: KvTransferSettings = Field(default_factory=lambda: KvTransferSettings())
    workflows: WorkflowSettings = Field(default_factory=WorkflowSettings)
    tracing: TracingSettings = Field(default_factory=lambda: TracingSettings())
    tokenizer: str | None = None
    """HF tokenizer directory the engines load (default: the shipped tiny tokenizer)."""
    admin_key: str | None = None
    """Key for /admin endpoints (Authorization: Bearer KEY); without one they are disabled."""
    engine_api_key: str | None = None
    """The key engines run with (vLLM's `--api-key`): the gateway's calls to them carry it in
    place of the client's `Authorization`. Without one, a client's `Authorization` is
    forwarded, unless tenants are configured (a tenant's key is the gateway's credential, and
    stays with it)."""
    tenants: dict[str, TenantEntry] = Field(default_factory=dict)
    """With tenants, every `/v1/` call needs a tenant's key (or, to read workflows and
    traces, the admin key), and each tenant's calls are cached apart from the others'."""

    @field_validator("admin_key")
    @classmethod
    def _admin_key(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if v != v.strip():
            raise ValueError("admin_key has spaces or a line break around it (a key read "
                             "from a file keeps its newline)")
        if len(v) < MIN_KEY_CHARS or v in PLACEHOLDER_KEYS:
            raise ValueError(f"admin_key must be a secret of at least {MIN_KEY_CHARS} "
                             "characters, not a placeholder (e.g. `openssl rand -hex 24`)")
        return v

    @field_validator("engine_api_key")
    @classmethod
    def _engine_api_key(cls, v: str | None) -> str | None:
        # Sent in a header: a trailing newline (a key read from a file) made aiohttp refuse
        # every call to the engines, which then all failed their health checks with nothing
        # said above debug level.
        if v is None:
            return v
        if not v:
            raise ValueError("engine_api_key is empty (leave it out when engines run without "
                             "--api-key)")
        if v != v.strip() or not v.isascii() or not v.isprintable():
            raise ValueError("engine_api_key has spaces, a line break or other characters a "
                             "header cannot carry around or in it (a key read from a file "
                             "keeps its newline)")
        return v

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_there(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.strip():  # it would load whatever tokenizer the working directory holds
            raise ValueError("tokenizer is empty (leave it out for the shipped tiny tokenizer)")
        return v

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, v: dict[str, TenantEntry]) -> dict[str, TenantEntry]:
        for name in v:
            if not TENANT_NAME.fullmatch(name):
                raise ValueError(f"tenant name {name!r}: letters, digits and . _ - (at most "
                                 "64, starting with a letter or digit)")
        keys = [k for t in v.values() for k in t.keys]
        if len(set(keys)) != len(keys):
            raise ValueError("a key stands for one tenant only; a key is listed twice")
        return v

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        known = planner_names()
        if v not in known:
            raise ValueError(f"unknown policy {v!r}; known: {', '.join(known)}")
        return v

    @field_validator("kv_events_bind")
    @classmethod
    def _bind_endpoint(cls, v: str | None) -> str | None:
        return check_zmq_endpoint(v)

    @model_validator(mode="after")
    def _admin_key_is_no_tenants(self) -> GatewayConfig:
        if self.admin_key is not None and any(self.admin_key in t.keys
                                              for t in self.tenants.values()):
            raise ValueError("the admin key may not also be a tenant's key")
        return self

    @model_validator(mode="after")
    def _unique_engine_names(self) -> GatewayConfig:
        for what, values in (("engine names", [e.engine_name for e in self.engines]),
                             ("KV-event topics", [e.topic for e in self.engines])):
            dupes = sorted({v for v in values if values.count(v) > 1})
            if dupes:
                raise ValueError(f"{what} must be unique, repeated: {', '.join(dupes)}")
        urls = [e.url for e in self.engines]
        for i, url in enumerate(urls):
            problem = same_engine(url, urls[:i])
            if problem:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _settings_that_do_something(self) -> GatewayConfig:
        # Each of these was taken and did nothing, while its writer thought it did.
        if self.index.redis_url is not None and self.index.backend != "redis":
            raise ValueError("index.redis_url is set but index.backend is memory: add "
                             "`backend: redis` for replicas to share the index (or drop the URL)")
        if self.workflows.redis_url is not None and self.workflows.store != "redis":
            raise ValueError("workflows.redis_url is set but workflows.store is memory: add "
                             "`store: redis` for replicas to share workflows (or drop the URL)")
        otlp = {"otlp-http", "otlp-grpc"} & set(self.tracing.exporter)
        if not otlp and (self.tracing.endpoint is not None or self.tracing.headers):
            raise ValueError("tracing.endpoint and tracing.headers are for an OTLP exporter: "
                             "add otlp-http or otlp-grpc to tracing.exporter")
        return self


def same_engine(url: str, others: Sequence[str]) -> str | None:
    """Why the engine at `url` cannot join those at `others` as an engine of its own (the
    same address as one of them, e.g. `localhost` beside `127.0.0.1`), or None."""
    address = engine_address(url)
    for other in others:
        if engine_address(other) == address:
            return (f"engines {other} and {url} are one engine (the same address); "
                    "list it once")
    return None


def _model_at(loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The config section a key path leads to (`engines.0` is an EngineEntry)."""
    model: type[BaseModel] = GatewayConfig
    parts = list(loc)
    while parts:
        field = model.model_fields.get(str(parts.pop(0)))
        if field is None:
            return None
        kind: Any = field.annotation
        while get_origin(kind) in (list, dict):
            kind = get_args(kind)[-1]
            if parts:
                parts.pop(0)  # the list index or the mapping key
        if not (isinstance(kind, type) and issubclass(kind, BaseModel)):
            return None
        model = kind
    return model


def _format(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            section = _model_at(e["loc"][:-1])
            if section is not None:
                msg += f"; known keys here: {', '.join(section.model_fields)}"
        lines.append(f"{source}: {loc}: {msg}")
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
        data = load_yaml(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file") from None
    except OSError as e:  # a directory, no permission
        raise ConfigError(f"{p}: cannot read it: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if isinstance(data, dict):
        apply_overrides(data, overrides)
        _profile_files_relative_to(data, p.parent)
    return parse_config(data, str(p))


def _profile_files_relative_to(data: dict[str, Any], directory: Path) -> None:
    """A relative `profile_file:` names a file next to the config, wherever kvgate runs."""
    engines = data.get("engines")
    for e in engines if isinstance(engines, list) else []:
        if isinstance(e, dict) and isinstance(e.get("profile_file"), str):
            e["profile_file"] = str(directory / e["profile_file"])


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set command-line values into a config mapping; `a.b` keys reach nested sections."""
    for key, value in overrides.items():
        if value is None:
            continue
        if "." in key:
            head, tail = key.split(".", 1)
            section = data.get(head)
            if section is None:  # absent, or `head:` with nothing under it
                section = data[head] = {}
            if not isinstance(section, dict):
                raise ConfigError(f"{head}: expected a mapping of settings (the command line "
                                  f"sets {key}), got {section!r}")
            section[tail] = value
        else:
            data[key] = value
    return data
