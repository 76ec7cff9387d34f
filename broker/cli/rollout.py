"""`tgw-broker models load --shadow/--policy` and `models diff`: the safe-change flags and what a
shadow's comparison and a guarded rollout look like on a terminal (docs/ROLLOUT.md)."""
from __future__ import annotations

import argparse
from typing import Any

import msgspec

from tgw.shm.wire import PROTOCOL_VERSION, RolloutPolicy, Status, StatusReply

POLICY_KEYS = RolloutPolicy.__struct_fields__


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1], e.g. 0.1 for 10 %")
    return value


class PolicyAction(argparse.Action):
    """KEY=VALUE pairs of a RolloutPolicy, each value a number (or `none`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        fields: dict[str, Any] = {}
        for pair in values:
            key, sep, text = pair.partition("=")
            if not sep or key not in POLICY_KEYS:
                parser.error(f"--policy {pair!r}: want KEY=VALUE with KEY one of {', '.join(POLICY_KEYS)}")
            try:
                fields[key] = None if text.lower() == "none" else (int(text) if key in INTEGERS else float(text))
            except ValueError:
                parser.error(f"--policy {pair!r}: {text!r} is not a number")
        try:
            setattr(namespace, self.dest, msgspec.convert(fields, RolloutPolicy))
        except msgspec.ValidationError as exc:
            parser.error(f"--policy: {exc}")


INTEGERS = ("promote_after_requests", "min_requests")


def add_load_flags(load: argparse.ArgumentParser) -> None:
    load.add_argument("--shadow", type=fraction, metavar="FRACTION",
                      help="load as a shadow: no traffic of its own, this fraction of the answered requests copied "
                           "to it and its outputs compared (`models diff`); excludes --weight")
    load.add_argument("--policy", nargs="+", action=PolicyAction, metavar="KEY=VALUE",
                      help="guard a canary (--weight) or shadow: promote after promote_after_requests or "
                           "promote_after_s with every bound kept (max_error_rate, max_p99_ms, max_p99_ratio, and for "
                           "a shadow max_abs_diff, max_rel_error, min_top1_agreement, min_exact_agreement), roll back "
                           "at once when one breaks")


class Diff:
    """`models diff NAME`: the status, narrowed to one model's shadows and guarded rollout."""

    def __init__(self) -> None:
        self.model = ""

    def request(self, args) -> Status:
        self.model = args.model
        return Status(v=PROTOCOL_VERSION)

    def __call__(self, reply: StatusReply) -> None:
        r = reply.rollouts
        mine = [(s, "") for s in r.get("shadows", []) if s["model"] == self.model] + \
               [(s, s.get("ended", "")) for s in r.get("ended_shadows", []) if s["model"] == self.model]
        if not mine:
            print(f"{self.model}: no shadow now or lately")
        for shadow, ended in mine:
            for line in shadow_lines(shadow, ended):
                print(line)
        for g in r.get("guarded", []):
            if g["model"] == self.model:
                print(f"guard of {g['version']} ({g['kind']}): {g['state']} for {g['since_s']:.1f} s; "
                      f"observed {_pairs(g['observed'])}; policy {_pairs(g['policy'])}")
        for d in r.get("decisions", []):
            if d["model"] == self.model:
                print(f"decision: {d['decision']} {d['version']} after {d['after_s']:.1f} s: {d['why']}")


def shadow_lines(s: dict, ended: str) -> list[str]:
    state = f"ended ({ended})" if ended else "active"
    lines = [f"{s['model']} shadow {s['version']}, {state}: {s['fraction']:.1%} copied for {s.get('for_s', 0):.1f} s; "
             f"copied {s['copied']}, compared {s['compared']}, dropped {s['dropped']}, "
             f"failed {_pairs(s['failed']) or 0}"]
    for name, o in s["outputs"].items():
        lines.append(f"  output {name}: {_pairs(o)}")
    return lines


def _pairs(d: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items())
