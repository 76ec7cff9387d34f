"""`tgw-broker models ...` and `tgw-broker reload`: the operator's model lifecycle verbs.

Each verb is a request builder and a printer; cli/main.py sends the request over its one
connection path (flags, token, CURVE) and prints the reply with the printer, or as JSON.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Iterator

from tgw.shm.model_format import MODEL_FORMATS
from tgw.shm.wire import (PROTOCOL_VERSION, ControlReply, LoadVersion, Metadata, MetadataReply, ModelMetadata,
                          Reload, SetTraffic, UnloadVersion)

from tgw.broker.models.replay import summary as replay_summary

from . import convert, load_progress, rollout as cli_rollout

CONTROL_WAIT_S = 600.0   # load, unload and reload answer once loads and drains are done
QUERY_WAIT_S = 5.0
TRAFFIC_WAIT_S = 60.0    # instant, but control ops run one at a time: it may wait behind a load


# ---- arguments -------------------------------------------------------------------------------

def non_negative_int(text: str) -> int:
    # ASCII digits only: str.isdigit() also takes "²", which int() refuses
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return int(text)


def sha256_hex(text: str) -> str:
    """A checksum mistyped here would only come back as a checksum mismatch after the load."""
    digest = text.strip().lower()
    if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
        raise argparse.ArgumentTypeError(f"{text!r} is not a SHA-256 digest (64 hex digits)")
    return digest


def parse_weights(pairs: list[str]) -> dict[str, int]:
    """["1=90", "2=10"] -> {"1": 90, "2": 10}; ValueError naming the first bad pair."""
    weights: dict[str, int] = {}
    for pair in pairs:
        version, sep, weight = pair.partition("=")
        if not sep or not version:
            raise ValueError(f"{pair!r} is not VERSION=WEIGHT")
        if version in weights:
            raise ValueError(f"version {version!r} is given twice")
        try:
            weights[version] = non_negative_int(weight)
        except argparse.ArgumentTypeError:
            raise ValueError(f"{pair!r}: the weight {weight!r} is not a non-negative integer") from None
    return weights


class WeightsAction(argparse.Action):
    """Parses every VERSION=WEIGHT at once (a duplicate is only seen across pairs); a bad one is
    a usage error, like any other bad argument."""

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            setattr(namespace, self.dest, parse_weights(values))
        except ValueError as exc:
            parser.error(str(exc))


def add_verbs(sub, broker_verb) -> None:
    """Add `models {list,load,unload,traffic,metadata,convert}` and `reload` to the subcommands `sub`;
    `broker_verb(sub, name, help, wait_s, request, show)` (cli/main.py) makes each parser."""
    models = sub.add_parser("models", help="list, load, unload, weigh and describe model versions")
    verbs = models.add_subparsers(dest="verb", required=True)

    def model_verb(name, help_text, wait_s, request, show, **name_kw):
        # NAME first: positionals are matched in the order they are added
        parser = broker_verb(verbs, name, help_text, wait_s, request, show)
        parser.add_argument("model", metavar="NAME", **{"help": "a model declared in the config", **name_kw})
        return parser

    broker_verb(verbs, "list", "every model: residency, default version, versions with state and weight",
                QUERY_WAIT_S, lambda args: Metadata(v=PROTOCOL_VERSION), print_models)
    load = model_verb("load", "load a new version of a declared model or stage (no --weight: a hot swap); or "
                      "register a TorchServe archive of the model store (NAME: FILE.mar)",
                      CONTROL_WAIT_S, load_request, print_control)
    load.add_argument("--version", help="the new version's name (a name in use is refused); required, but for an "
                                        "archive (its MANIFEST names its version)")
    load.add_argument("--batch-size", type=non_negative_int, help="an archive's batch_size (TorchServe's register)")
    load.add_argument("--max-batch-delay", type=non_negative_int, metavar="MS",
                      help="an archive's max_batch_delay in ms (TorchServe's register)")
    load.add_argument("--name", help="an archive's model_name (default: its MANIFEST's)")
    source = load.add_mutually_exclusive_group()
    source.add_argument("--path", help="a model's file inside the config's model_roots; a relative path is taken "
                                       "from the current directory (default: the path the config declares for "
                                       "this version)")
    source.add_argument("--handler", metavar="FILE.py:Class",
                        help="a stage's class: a FILE.py inside model_roots (a relative one is taken from the current "
                             "directory), or module:Class (default: the handler the config declares for this version)")
    load.add_argument("--sha256", type=sha256_hex, help="the file's (or handler file's) SHA-256; the worker checks "
                                                        "the bytes it loads")
    load.add_argument("--format", choices=MODEL_FORMATS, help="what the file must hold (default: whatever it holds)")
    load.add_argument("--weight", type=non_negative_int,
                      help="canary: add beside the other versions with this weight (0: only when named); "
                           "default: hot swap, the new version takes all unnamed traffic and the old ones unload")
    cli_rollout.add_load_flags(load)
    load.set_defaults(progress=load_progress.watch)   # its phases on stderr while it waits, on a terminal
    diff = cli_rollout.Diff()
    model_verb("diff", "a shadow's outputs against the serving version's, and the model's guarded rollout",
               QUERY_WAIT_S, diff.request, diff)
    unload = model_verb("unload", "drain and unload a version (default: every version of the model)",
                        CONTROL_WAIT_S, lambda args: UnloadVersion(v=PROTOCOL_VERSION, model=args.model,
                                                                   version=args.version), print_control)
    unload.add_argument("--version", help="the version to unload (default: all of them)")
    traffic = model_verb("traffic", "set the weights that split the requests naming no version", TRAFFIC_WAIT_S,
                         lambda args: SetTraffic(v=PROTOCOL_VERSION, model=args.model, weights=args.weights),
                         print_control)
    traffic.add_argument("weights", nargs="+", action=WeightsAction, metavar="VERSION=WEIGHT",
                         help="e.g. 1=90 2=10; versions not listed get 0")
    model_verb("metadata", "inputs, outputs and per version its state, weight, memory and workers", QUERY_WAIT_S,
               lambda args: Metadata(v=PROTOCOL_VERSION, model=args.model), print_metadata,
               nargs="?", help="a model (default: every model)")
    convert.add_verb(verbs)
    broker_verb(sub, "reload", "re-read the config file and apply the difference, as SIGHUP does",
                CONTROL_WAIT_S, lambda args: Reload(v=PROTOCOL_VERSION), print_control)


def load_request(args) -> LoadVersion:
    return LoadVersion(v=PROTOCOL_VERSION, model=args.model, version=args.version, path=from_here(args.path),
                       sha256=args.sha256, weight=args.weight, format=args.format,
                       handler=handler_from_here(args.handler), shadow=args.shadow, policy=args.policy)


def from_here(path: str | None) -> str | None:
    """A relative --path taken from the current directory, as the config takes its paths from its
    own folder: joined, not normalised, so the broker still refuses a '..' as written and a file
    outside model_roots, with its reason. (A broker on another host needs an absolute path.)"""
    return path if path is None or os.path.isabs(path) else os.path.join(os.getcwd(), path)


def handler_from_here(handler: str | None) -> str | None:
    """--handler FILE.py:Class with FILE.py taken from the current directory; module:Class as given."""
    if handler is None:
        return None
    where, sep, cls = handler.rpartition(":")
    return f"{from_here(where)}{sep}{cls}" if where.endswith(".py") else handler


# ---- printing --------------------------------------------------------------------------------

def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def share(weight: int, total: int) -> str:
    """A weight as a percentage of the weights' sum, e.g. "90%", "33.3%", "0.1%"."""
    return f"{100 * weight / total:.3g}%" if total else "0%"


def versions_line(model: ModelMetadata) -> str:
    """e.g. "1 ready 90%, 2 ready 10%"."""
    total = sum(v.weight for v in model.versions)
    return ", ".join(f"{v.version} {v.state} {share(v.weight, total)}" for v in model.versions) or "none loaded"


def print_models(reply: MetadataReply) -> None:
    width = max([len(m.name) for m in reply.models] + [5]) + 2
    print(f"{'model':<{width}}{'residency':<11}{'default':<9}versions")
    for m in reply.models:
        print(f"{m.name:<{width}}{m.residency:<11}{m.default_version or '-':<9}{versions_line(m)}")


def print_metadata(reply: MetadataReply) -> None:
    for m in reply.models:
        print(f"{m.name}: {m.residency}, default version {m.default_version or 'none'}, "
              f"max batch {m.max_batch_size}")
        for kind, specs in (("input", m.inputs), ("output", m.outputs)):
            for spec in specs:
                print(f"  {kind:<7}{spec.name} {spec.dtype} {spec.shape}")
        total = sum(v.weight for v in m.versions)
        for v in m.versions:
            print(f"  version {v.version}: {v.state}, weight {v.weight} ({share(v.weight, total)}), {mib(v.bytes)}, "
                  f"loads {v.loads}, evictions {v.evictions}, last load {v.last_load_ms:.0f} ms")
            print(f"    path {v.path} ({v.format})" + (f", sha256 {v.sha256}" if v.sha256 else ""))
            if v.workers:
                print("    " + ", ".join(f"{worker} {state}" for worker, state in v.workers.items()))


def print_control(reply: ControlReply) -> None:
    print(reply.message)
    figures = {key: value for key, value in reply.details.items() if key != "events"}
    for line in [*figure_lines(figures), *map(event_line, reply.details.get("events", []))]:
        print(f"  {line}")
    if reply.model is not None:
        print(f"  {reply.model.name} now: {versions_line(reply.model)}")


def event_line(event: dict[str, Any]) -> str:
    """A lifecycle event (status, control replies), absent parts left out, e.g.
    "at 12.3 s load mlp:2 on worker0[cpu], 812 ms, 44.7 MiB, RSS 100 -> 145 MiB: MESSAGE"."""
    subject = ":".join(str(event[key]) for key in ("model", "version") if event.get(key))
    where = f"on {event['worker']}" if event.get("worker") else ""
    why = f"({event['reason']})" if event.get("reason") else ""
    head = " ".join(filter(None, (f"at {event.get('at_s', 0):.1f} s", event.get("event", "?"), subject, where, why)))
    figures = [f"{event['ms']:.0f} ms"] if event.get("ms") else []
    figures += [mib(event["bytes"])] if event.get("bytes") else []
    if "rss_before" in event and "rss_after" in event:
        figures.append(f"RSS {event['rss_before'] / 2**20:.0f} -> {event['rss_after'] / 2**20:.0f} MiB")
    figures += [replay_summary(event["replay"])] if event.get("replay") else []
    message = event.get("message")   # a failed load's: its text, then its cause and fix lines
    return with_message(", ".join([head, *figures]), message and message.replace("\n", "\n      "))


def with_message(line: str, message: str | None) -> str:
    return f"{line}: {message}" if message else line


def figure_lines(details: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """One line per figure, a map of maps (e.g. per worker) one line per inner map:
    "load_ms 812 ms", "workers worker0[cpu]: load_ms 812 ms, bytes 44.7 MiB"."""
    for key, value in details.items():
        label = f"{prefix}{key}"
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            yield from figure_lines(value, label + " ")
        elif isinstance(value, dict):
            yield f"{label}: " + ", ".join(f"{k} {figure(k, v)}" for k, v in value.items())
        else:
            yield f"{label} {figure(key, value)}"


def figure(key: str, value: Any) -> str:
    """A figure with its unit, read from its key: bytes and rss_* in MiB, *_ms in ms."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return ", ".join(map(str, value)) if isinstance(value, list) else str(value)
    if key == "bytes" or key.endswith("_bytes") or key.startswith("rss"):
        return mib(value)
    if key.endswith("_ms"):
        return f"{value:.0f} ms"
    return f"{value:g}"
