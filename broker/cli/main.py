"""`tgw-broker`: start (with a config, or the embedded demo), check-config, status, snapshot, metrics, keygen,
and the model lifecycle verbs of cli/models.py (models ..., reload)."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from tgw.shm.wire import PROTOCOL_VERSION, Scrape, Snapshot, Status

from . import archive_load, connect, load_progress, models as cli_models
from tgw.broker.config.load import ConfigError, load_config, parse_config

RECENT_EVENTS = 5      # lifecycle events `status` shows; --json has all the broker keeps
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
CLOSED_PIPE_EXIT = 141   # 128 + SIGPIPE: as a command the signal ended


def query(args) -> int:
    """A verb that asks a running broker: send `args.request(args)`, print the reply with
    `args.show` (or as JSON); 1 with the reason on stderr if it fails."""
    import json
    from functools import partial

    from tgw.shm.errors import TgwError
    from tgw.shm.wire import as_builtins

    from .ask import Unreachable, ask
    from tgw.broker.config.startup import StartupError
    try:
        to = connect.resolve(args)
        with progress(args, to):
            reply = ask(to.address, args.request(args), args.timeout, token=to.token, server_key=to.server_key)
    except (Unreachable, TgwError, StartupError, connect.ConnectProblem) as exc:
        print(f"{args.label}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(as_builtins(reply), indent=2, sort_keys=True))   # every field, defaults too
    else:
        (args.show or partial(print_status, to.address))(reply)   # status heads its table with the address
    return 1 if getattr(reply, "missing", None) else 0           # a snapshot some worker did not answer


def progress(args, to: connect.Connection):
    """What shows a verb's progress while it waits (`models load`'s phases, on a terminal), else nothing."""
    from contextlib import nullcontext
    watch = getattr(args, "progress", None)   # set by a verb that has progress to show
    if watch is None or not load_progress.wanted(args):
        return nullcontext()
    return watch(args, to.address, to.token, to.server_key)


def broker_verb(sub, name: str, help_text: str, wait_s: float, request, show=None) -> argparse.ArgumentParser:
    """A subcommand that asks a running broker: the connection flags (connect.py), and what
    `query` runs: `request(args)` builds the message, `show(reply)` prints the answer."""
    q = sub.add_parser(name, help=help_text)
    connect.add_flags(q)
    q.add_argument("--json", action="store_true", help="print the reply as JSON")
    q.add_argument("--timeout", type=float, default=wait_s, help=f"seconds to wait for the answer (default {wait_s:g})")
    q.set_defaults(request=request, show=show, label=q.prog)
    return q


def print_snapshot(reply) -> None:
    print("\n".join(reply.files + [f"no answer from {name}" for name in reply.missing]))


def keygen(args) -> int:
    """Write a CURVE key pair for server.curve_secret_key_file and print how to use it."""
    from tgw.broker.front.auth import keygen as write_pair
    try:
        public, secret = write_pair(args.dir, args.name)
    except (OSError, ValueError) as exc:
        print(f"tgw-broker keygen: {exc}", file=sys.stderr)
        return 1
    import shlex

    import zmq.auth
    z85_key = zmq.auth.load_certificate(public)[0].decode()
    print(f"public key (give to clients): {public}\nsecret key (broker only, 0600): {secret}\n\n"
          f"broker config:\n  server:\n    address: tcp://HOST:PORT\n    curve_secret_key_file: {secret}\n\n"
          f"clients: Client(address, server_key={public!r}), or TGW_SERVER_KEY={shlex.quote(public)}\n"
          f"  or the key itself: TGW_SERVER_KEY={shlex.quote(z85_key)}\n"
          f"  tgw-broker status --address tcp://HOST:PORT --server-key {shlex.quote(public)}\n"
          f"other languages: set ZMQ_CURVE_SERVERKEY to {z85_key} (z85) and give the socket any client key pair")
    return 0


def print_status(address: str, reply) -> None:
    print(f"{address}: {reply.phase}, up {reply.uptime_s:.0f} s"
          + (f"; HTTP (KServe v2) on {reply.http}" if reply.http else "")
          + (f"; gRPC (KServe v2) on {reply.grpc}" if reply.grpc else "")
          + ("; TorchServe inference on {} and management on {}".format(*reply.torchserve.split())
             if reply.torchserve else ""))
    print(f"{'worker':<16}{'pid':>8} {'state':<9}{'inflight':>9}{'rss MiB':>9}{'batches':>9}{'beat s':>8}"
          f"{'restarts':>9}  last death / benched")
    for w in reply.workers:
        rss = f"{w['rss'] / 2**20:.0f}" if "rss" in w else "-"
        age = "-" if w["heartbeat_age_s"] is None else f"{w['heartbeat_age_s']:.1f}"
        print(f"{w['name']:<16}{w['pid']:>8} {w['state']:<9}{w['inflight']:>9}{rss:>9}{w.get('batches', '-'):>9}"
              f"{age:>8}{w['restarts']:>9}  {w['benched'] or w['last_death']}")
        if "gpu_ooms" in w:
            print(f"  {gpu_line(w)}")
    if reply.fronts.get("configured"):
        print(fronts_line(reply.fronts))
    print(f"{'model':<16}{'ready':>6}{'queued':>8}{'requests':>10}{'replies':>9}  errors")
    for name, m in reply.models.items():
        print(f"{name:<16}{'yes' if m['ready'] else 'no':>6}{m['queued']:>8}{m['requests']:>10}{m['replies']:>9}  "
              f"{m['errors'] or ''}")
    for name, m in reply.models.items():
        if m.get("cache"):
            print(cache_line(name, m["cache"]))
        if m.get("generation"):
            print(generation_line(name, m["generation"]))
        if m.get("sequences"):
            print(sequences_line(name, m["sequences"]))
    for name, p in reply.pipelines.items():
        print(f"pipeline {name}: {p['requests']} requests, {p['replies']} replies, {p['inflight']} in flight"
              + (f", errors {p['errors']}" if p["errors"] else ""))
        for step, s in p["steps"].items():
            print(f"  step {step:<12} {s['model']:<16} sent {s['sent']:>7}  ok {s['ok']:>7}  failed {s['failed']:>5}"
                  f"  mean {s['latency_ms']['mean']:.2f} ms  p99 {s['latency_ms']['p99']:.2f} ms")
    if reply.jobs.get("submitted"):
        print(jobs_line(reply.jobs))
    for path in reply.snapshots:
        print(f"snapshot: {path}")
    if reply.reload:
        print(reload_line(reply.reload))
    if reply.events:
        print("recent model events:")
        for event in reply.events[-RECENT_EVENTS:]:
            print(f"  {cli_models.event_line(event)}")


def fronts_line(f: dict) -> str:
    """The front processes (docs/FRONTS.md): "fronts: 2/2 alive, 1 restart; 0 pid 4242 (12 in flight,
    5120 requests, 3 forwarded), 1 pid 4243 (...)"."""
    lives = ", ".join(f"{life['index']} pid {life['pid']} ({life['inflight']} in flight, {life['requests']} requests, "
                      f"{life['forwarded']} forwarded)" for life in f["lives"])
    return (f"fronts: {f['alive']}/{f['configured']} alive, {f['restarts']} restart{'s' if f['restarts'] != 1 else ''}"
            + (f"; {lives}" if lives else ""))


def cache_line(model: str, c: dict) -> str:
    """A model's response cache: "cache mlp: 812 entries, 0.8/64.0 MiB, 1500 hits, 812 misses, evictions {}"."""
    return (f"cache {model}: {c['entries']} entries, {c['bytes'] / 2**20:.1f}/{c['max_bytes'] / 2**20:.1f} MiB, "
            f"{c['hits']} hits, {c['misses']} misses, evictions {c['evictions']}")


def generation_line(model: str, g: dict) -> str:
    """A generator's sequences: "generator tiny-gpt: 3/64 slots busy, 1200 outputs (45.2/s), first output
    12.3 ms, between outputs 4.5 ms (means), resumed 0, freed by cancel 2, ended {'max_outputs': 20}"."""
    return (f"generator {model}: {g['active']}/{g['slots']} slots busy, {g['outputs']} outputs "
            f"({g['outputs_per_s']:.1f}/s), first output {g['first_output_ms']:.1f} ms, between outputs "
            f"{g['between_outputs_ms']:.1f} ms (means), resumed {g['resumed']}, freed by cancel "
            f"{g['freed_by_cancel']}, ended {g['ended']}")


def sequences_line(model: str, s: dict) -> str:
    """A sequence model's sequences: "sequences accumulator: 3/128 slots live, 40 started, 1200 steps,
    0 misrouted, 2 refused, ended {'end': 37}" (docs/SEQUENCES.md)."""
    return (f"sequences {model}: {s['live']}/{s['slots']} slots live, {s['started']} started, {s['steps']} steps, "
            f"{s['misrouted']} misrouted, {s['refused']} refused, ended {s['ended']}")


def jobs_line(j: dict) -> str:
    """Polled jobs: "jobs: 2 live, 5 kept (0.1/256.0 MiB), 9 submitted, 6 done, 1 failed, 0 cancelled, 2
    expired, 0 evicted, 0 refused, 0 too large"."""
    return (f"jobs: {j['live']} live, {j['kept']} kept ({j['bytes'] / 2**20:.1f}/{j['max_result_bytes'] / 2**20:.1f} "
            f"MiB), {j['submitted']} submitted, {j['done']} done, {j['failed']} failed, {j['cancelled']} cancelled, "
            f"{j['expired']} expired, {j['evicted']} evicted, {j['refused']} refused, {j['too_large']} too large")


def gpu_line(w: dict) -> str:
    """A GPU worker's device at its last heartbeat: "gpu: 3.1/80.0 GiB, 42% busy, 61 °C, 250 W; 0 OOMs"
    ("-" for a figure the device does not report; "no NVML figures" where NVML cannot say)."""
    g, ooms = w.get("gpu"), f"{w['gpu_ooms']} OOM{'' if w['gpu_ooms'] == 1 else 's'}"
    if not g:
        return f"gpu: no NVML figures; {ooms}"

    def fig(key: str, form: str, scale: float = 1.0) -> str:
        return "-" if g.get(key) is None else format(g[key] * scale, form)
    return (f"gpu: {fig('memory_used', '.1f', 2**-30)}/{fig('memory_total', '.1f', 2**-30)} GiB, "
            f"{fig('utilization', '.0f', 100)}% busy, {fig('temperature_c', '.0f')} °C, {fig('power_w', '.0f')} W; "
            f"{ooms}")


def reload_line(reload: dict) -> str:
    """"config: PATH, last reload OK at T s: MESSAGE" (the path alone before any reload)."""
    line = f"config: {reload.get('path') or '-'}"
    if reload.get("at_s") is None:
        return line
    outcome = "OK" if reload.get("ok") else "FAILED"
    return cli_models.with_message(f"{line}, last reload {outcome} at {reload['at_s']:.1f} s", reload.get("message"))


class Parser(argparse.ArgumentParser):
    """The top parser: what one flag's parser cannot see is a usage error too."""

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, namespace)
        if ns.cmd == "models" and ns.verb == "load" and not archive_load.is_archive(ns.model) and (
                ns.version is None or (ns.batch_size, ns.max_batch_delay, ns.name) != (None, None, None)):
            self.error("models load: the following arguments are required: --version (--batch-size, "
                       "--max-batch-delay and --name are an archive's: models load FILE.mar)")
        return ns


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="tgw-broker", description="tgw torch inference gateway broker")
    sub = ap.add_subparsers(dest="cmd", required=True)
    start = sub.add_parser("start", help="serve (the embedded demo models when no --config is given)")
    start.add_argument("--config", help="YAML config file")
    start.add_argument("--address", help="override server.address, e.g. ipc:///run/tgw/tgw.sock")
    start.add_argument("--model-repository", metavar="DIR", action="append",
                       help="serve a Triton model repository (config.pbtxt and numbered version folders per model; "
                            "repeat for more) beside the config's models, or alone without --config "
                            "(docs/MIGRATING.md)")
    start.add_argument("--log-level", default="INFO", help=f"one of {', '.join(LOG_LEVELS)} (default INFO)")
    start.add_argument("--log-format", choices=("text", "json"), default=os.environ.get("TGW_LOG_FORMAT") or "text",
                       help="text lines, or one JSON object per line (the workers' too; default: $TGW_LOG_FORMAT, "
                            "else text)")
    start.add_argument("--http-port", type=int, help="serve the KServe v2 HTTP face (and /metrics) on this port "
                       "(0: any free one; the host is http.host, default 127.0.0.1)")
    start.add_argument("--grpc-port", type=int, help="serve the KServe v2 gRPC face (with grpc.health.v1 and "
                       "reflection) on this port (0: any free one; the host is grpc.host, default 127.0.0.1)")
    start.add_argument("--model-store", help="serve the TorchServe archives (.mar) of this folder: TorchServe's "
                       "inference and management APIs on torchserve.inference_port / management_port (8080, 8081)")
    start.add_argument("--models", nargs="+", metavar="MODEL", help="with --model-store: the archives served at start, "
                       "as TorchServe's --models: all, NAME=FILE.mar or FILE.mar")
    start.add_argument("--ts-inference-port", type=int, help="TorchServe's inference API on this port (0: any free one)")
    start.add_argument("--ts-management-port", type=int, help="TorchServe's management API on this port "
                       "(0: any free one)")
    start.add_argument("--progress", choices=("auto", "on", "off"),
                       help="each model's loading/warming/ready lines on stderr (default: $TGW_PROGRESS, else auto: "
                            "when stderr is a terminal and the log format is text)")
    check = sub.add_parser("check-config", help="validate a config file (model files included) and exit")
    check.add_argument("file", nargs="?", help="the YAML config (optional with --model-repository)")
    check.add_argument("--model-repository", metavar="DIR", action="append",
                       help="a Triton model repository, as start takes it")
    check.add_argument("--load", action="store_true",
                       help="also load and warm up every model and stage version as a worker would, in a child "
                            "process (torch; no broker starts), and report each: exit 1 when one fails")
    check.add_argument("--verbose", action="store_true",
                       help="with --load: also show what torch and the handlers wrote while loading")
    broker_verb(sub, "status", "workers, models and queues of a running broker", 5.0,
                lambda args: Status(v=PROTOCOL_VERSION))
    snapshot = broker_verb(sub, "snapshot", "write a memory snapshot of each live worker, print the files", 30.0,
                           lambda args: Snapshot(v=PROTOCOL_VERSION, worker=args.worker), print_snapshot)
    snapshot.add_argument("--worker", type=int, help="only worker N (as in worker<N>[...])")
    broker_verb(sub, "metrics", "the Prometheus metrics of a running broker (what GET /metrics serves)", 5.0,
                lambda args: Scrape(v=PROTOCOL_VERSION), lambda reply: sys.stdout.write(reply.text))
    cli_models.add_verbs(sub, broker_verb)
    kg = sub.add_parser("keygen", help="write a CURVE key pair (DIR/NAME.key, DIR/NAME.key_secret) for tcp://")
    kg.add_argument("dir", help="directory to write to (created 0700 if missing)")
    kg.add_argument("--name", default="broker", help="file name stem (default: broker)")
    return ap


def start_problem(args) -> str | None:
    """What is wrong with `start`'s flags, in one line (None: nothing), before anything starts."""
    from tgw.shm.paths import ADDRESS_FORMS, address_problem
    if args.log_level.upper() not in LOG_LEVELS:
        return f"--log-level {args.log_level!r}: not one of {', '.join(LOG_LEVELS)}"
    problem = address_problem(args.address, bind=True) if args.address is not None else None
    return f"--address {args.address!r}: {problem}; expected {ADDRESS_FORMS}" if problem else None


def configured(path: str | None, model_repository: list[str] | None):
    """The config of `--config`/check-config's FILE, with `--model-repository` (either may be missing)."""
    from tgw.broker.config.load import repository_config
    return load_config(path, model_repository) if path else repository_config(model_repository)


def main(argv: list[str] | None = None) -> None:
    """The `tgw-broker` entry point. A reader that goes away (`tgw-broker status | head -1`) ends
    the command quietly with status 141 (128 + SIGPIPE, what `cat` killed by the signal gives),
    not a BrokenPipeError traceback."""
    try:
        try:
            run(argv)
        finally:
            sys.stdout.flush()   # here, not at exit, where a closed pipe can no longer be caught
    except BrokenPipeError:
        # the interpreter flushes stdout again at exit: point it at /dev/null first
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(CLOSED_PIPE_EXIT)


def run(argv: list[str] | None) -> None:
    args = build_parser().parse_args(argv)

    if args.cmd == "keygen":
        sys.exit(keygen(args))

    if args.cmd == "models" and args.verb == "load" and archive_load.is_archive(args.model):
        sys.exit(archive_load.register(args))   # TorchServe's register, through its management API
    if hasattr(args, "local"):       # a verb that works here, without a broker (models convert)
        sys.exit(args.local(args))

    if hasattr(args, "request"):     # a verb that asks a running broker
        sys.exit(query(args))

    if args.cmd == "check-config":
        if args.file is None and args.model_repository is None:
            sys.exit("tgw-broker check-config: name a config FILE, --model-repository DIR, or both")
        from tgw.broker.torchserve.store import with_store
        try:
            cfg = with_store(configured(args.file, args.model_repository))
        except ConfigError as exc:
            sys.exit(str(exc))
        for line in cfg._repository_warnings:
            print(f"warning: {line}")
        names = ", ".join(m.name for m in cfg.models)
        print(f"{args.file or ' '.join(args.model_repository)}: OK ({len(cfg.models)} model(s): {names})")
        for m in cfg.models:
            print(f"  {m.name}: " + ", ".join(f"version {v.version} ({v.format})" for v in m.versions))
        if cfg.pipelines:
            from tgw.broker.config.pipelines import describe as describe_pipeline
            print(f"{len(cfg.pipelines)} pipeline(s):")
            for p in cfg.pipelines:
                print(describe_pipeline(p, {m.name: m for m in cfg.models}))
        from tgw.broker.config.arenas import describe
        print(describe(cfg))
        if args.load:
            from .check_load import check_load
            sys.exit(0 if check_load(cfg, verbose=args.verbose) else 1)
        return

    problem = start_problem(args)
    if problem:
        sys.exit(f"tgw-broker start: {problem}")
    from tgw.broker.observe.logs import setup
    setup(args.log_format, args.log_level.upper())
    if args.progress:   # read where the broker's progress printer is made (broker/observe/progress.py)
        os.environ["TGW_PROGRESS"] = args.progress
    from .demo import demo_config
    from tgw.broker.core.run import run_broker
    from tgw.broker.torchserve.store import with_flags, with_store
    try:
        if args.config or args.model_repository:
            cfg = configured(args.config, args.model_repository)
        elif args.model_store:   # TorchServe's way: the archives alone
            cfg = parse_config({"model_store": os.path.abspath(args.model_store)}, os.getcwd(), "--model-store")
        else:
            cfg = demo_config()
        cfg = with_store(with_flags(cfg, args.model_store, args.models, args.ts_inference_port,
                                    args.ts_management_port))
    except ConfigError as exc:
        sys.exit(str(exc))
    for line in cfg._repository_warnings:
        logging.getLogger("tgw.broker").warning("model repository: %s", line)
    from tgw.broker.config.load import with_grpc_port, with_http_port
    try:
        if args.http_port is not None:
            cfg = with_http_port(cfg, args.http_port)
        if args.grpc_port is not None:
            cfg = with_grpc_port(cfg, args.grpc_port)
    except ConfigError as exc:
        sys.exit(str(exc))
    sys.exit(run_broker(cfg, args.address, os.path.abspath(args.config) if args.config else None))
