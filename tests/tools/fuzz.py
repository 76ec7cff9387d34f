"""tgw fuzz: hostile frames at a broker of its own, with checked valid requests in between.

    python -m tools.fuzz [--count 100000] [--threads 4] [--check-every 50] [--seed 1]
    scripts/fuzz.sh [--count N]

Starts a broker (BrokerProc, one CPU worker) serving two of the demo models, built at run time
by `python -m tgw.workers.demo_models` (nothing is downloaded), then sends --count hostile frames from --threads DEALER sockets, one
thread each: random bytes, truncated or garbled MessagePack, valid headers with one field
mutated (wrong types, unknown ops, huge or bool ids, negative or huge shapes, too many dims or
tensors, wrong frame counts or lengths, bad lz4, lz4 declaring 2^48 bytes, headers over the
limit, empty frames...). Every --check-every frames a thread sends a VALID request and compares
its outputs with the same model file run in this process (torch.jit.load).

Which reply belongs to which frame: after each hostile frame the thread sends a `health`
request (the sentinel) and reads until the sentinel's reply. The broker answers a socket's
messages in order unless a request is queued for a worker, so a reply before the sentinel is
the frame's; a frame with none is "deferred", and one whose unique id comes back later is
"late" (it reached a worker). What never comes back by the end (after --drain s) is "no
reply", printed by category: the measured counterpart of docs/PROTOCOL.md's rule on which
frames get none. A frame answered twice, an undecodable reply, a sentinel lost (the socket is
then replaced) are counted as problems.

Prints: frames sent, replies by code, frames without reply by category, valid requests
checked / mismatched / failed, the broker's RSS at start and end, whether it is alive and
serving at the end, the lines of its log containing "Traceback", and every counter its stats
reply carries. Exit status 0; 1 when a valid request failed or mismatched, a frame was
answered twice or undecodably, the broker died or stopped serving, or its log has a traceback;
2 when it could not start. Bounded: every wait has a limit and the run stops after
--max-seconds whatever happens.
"""
# The frame makers are in fuzz_frames.py, the sender threads (sockets, sentinels, checked valid
# requests) in fuzz_sender.py; this module starts the broker, runs the senders and reports.
from __future__ import annotations

import argparse
import re
import sys
import time
from collections import Counter
from typing import Callable, Optional

import msgspec
import numpy as np
import zmq

from .fuzz_frames import MAX_REQUEST_BYTES, MODELS, Hostile, enc
from .fuzz_sender import VALID_WAIT_S, Reference, Sender, Tallies
from tgw.testing.demo import command_parser, demo_broker, run_command
from tgw.shm.wire import PROTOCOL_VERSION


def small_limits(cfg: dict) -> None:
    """The fuzz broker's config tweaks: small limits, so oversize frames stay cheap to send."""
    cfg["server"]["max_request_bytes"] = MAX_REQUEST_BYTES
    cfg["workers"].update(input_arena_mb=16, output_arena_mb=8)


# ---- the run --------------------------------------------------------------------------------

def rss_mb(pid: Optional[int]) -> Optional[float]:
    import psutil
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except (psutil.Error, TypeError):
        return None


def raw_stats(address: str) -> dict:
    """The broker's stats reply as it comes (untyped), so new counters show without code changes here."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    try:
        s.send(enc({"op": "stats", "v": PROTOCOL_VERSION, "id": 1}))
        return msgspec.msgpack.decode(s.recv()) if s.poll(10_000) else {}
    finally:
        s.close(0)
        ctx.term()


def serving(address: str, ref: Reference) -> tuple[bool, str]:
    """Whether the broker answers health as ready and computes a valid request correctly."""
    from tgw.client import Client
    try:
        with Client(address, connect_timeout=5.0) as c:
            if not c.health()["ready"]:
                return False, "health: not ready"
            x = {"x": np.linspace(-1, 1, 256, dtype=np.float32).reshape(1, 256)}
            got = c.infer("mlp", x, timeout=30.0)["y"]
            ok = np.allclose(got, ref.run("mlp", x, ["y"])["y"], rtol=1e-4, atol=1e-5)
            return ok, "ready, computes correctly" if ok else "ready, but a valid request came back wrong"
    except Exception as exc:  # noqa: BLE001 - any failure here is the answer
        return False, f"{type(exc).__name__}: {exc}"


def last_exceptions(log: str) -> list[str]:
    """The exception line that ends each traceback in a log (not the causes of chained ones)."""
    lines = log.splitlines()
    out = []
    for i, line in enumerate(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", line):
            after = " ".join(lines[i + 1:i + 3])
            if "During handling of the above" not in after and "The above exception was" not in after:
                out.append(line)
    return out


def report(t: Tallies, n: int, elapsed: float, threads: int) -> list[str]:
    lines = [f"frames sent: {n} hostile from {threads} sockets in {elapsed:.1f} s ({n / max(elapsed, 1e-9):.0f}/s), "
             f"plus {t.checked} checked valid requests"]
    total = Counter()
    for c in t.codes.values():
        total += c
    lines.append("replies by code: " + ", ".join(f"{k} {v}" for k, v in total.most_common()))
    lines.append(f"{'category':<18} {'sent':>7} {'replied':>7} {'late':>5} {'none':>6}  codes")
    for cat in sorted(t.sent):
        none = sum(v for k, v in t.no_reply.items() if k.split(":")[0] == cat)
        codes = ", ".join(f"{k} {v}" for k, v in t.codes[cat].most_common(4))
        lines.append(f"{cat:<18} {t.sent[cat]:>7} {sum(t.codes[cat].values()):>7} {t.late[cat]:>5} {none:>6}  {codes}")
    lines.append(f"frames with no reply: {sum(t.no_reply.values())}" + ("" if not t.no_reply else " - by category:"))
    lines += [f"  {v:>6}  {k}" for k, v in sorted(t.no_reply.items())]
    if t.twice:
        lines.append("frames answered more than once: " + ", ".join(f"{k} x{v}" for k, v in t.twice.items()))
    if t.unattributed:
        lines.append("replies matching no frame: " + ", ".join(f"{k} {v}" for k, v in t.unattributed.items()))
    if t.sockets_replaced:
        lines.append(f"sockets replaced after a lost sentinel: {t.sockets_replaced}")
    lines.append(f"valid requests: {t.checked} checked, {t.mismatched} mismatched, {t.failed} failed")
    return lines


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = command_parser("python -m tools.fuzz", __doc__)
    ap.add_argument("--count", type=int, default=100_000, help="hostile frames in all (default 100000)")
    ap.add_argument("--threads", type=int, default=4, help="sender threads, one DEALER socket each (default 4)")
    ap.add_argument("--check-every", type=int, default=50, help="a checked valid request every N frames per thread")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--drain", type=float, default=5.0, help="seconds to wait at the end for deferred replies")
    ap.add_argument("--max-seconds", type=float, default=900.0, help="stop sending after this long (default 900)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (models, config, broker log)")
    ap.add_argument("--only", type=lambda t: [x for x in t.split(",") if x],
                    help=f"only these frame makers, comma-separated: {','.join(Hostile.kinds())}")
    a = ap.parse_args(argv)
    if a.only and set(a.only) - set(Hostile.kinds()):
        ap.error(f"--only: choose from {','.join(Hostile.kinds())}")
    if a.count < 0 or a.threads < 1 or a.check_every < 1:
        ap.error("--count >= 0, --threads >= 1, --check-every >= 1")
    return a


def run(argv: Optional[list[str]] = None, out: Callable[[str], None] = print) -> tuple[int, dict]:
    """The whole run; returns (exit status, summary). `out` receives the report's lines."""
    a = parse(argv)
    with demo_broker(list(MODELS), 1, tweak=small_limits, keep=a.keep, out=out) as (broker, models):
        return fuzz(a, broker, models, out)


def fuzz(a: argparse.Namespace, broker, models: dict, out: Callable[[str], None]) -> tuple[int, dict]:
    ref = Reference(models)
    rss0 = rss_mb(broker.pid)
    t0 = time.monotonic()
    deadline = t0 + a.max_seconds
    shares = [a.count // a.threads + (1 if i < a.count % a.threads else 0) for i in range(a.threads)]
    senders = [Sender(i, broker.address, shares[i], a, ref, models, deadline) for i in range(a.threads)]
    for s in senders:
        s.start()
    for s in senders:
        s.join(a.max_seconds + 2 * VALID_WAIT_S + 60)
    elapsed = time.monotonic() - t0
    t = Tallies()
    for s in senders:
        if s.is_alive():
            t.problems.append(f"{s.name} still running past --max-seconds")
            continue
        s.drain(a.drain)
        t.merge(s.t)
    sent = sum(s.done for s in senders)
    for line in report(t, sent, elapsed, a.threads):
        out(line)
    alive = broker.alive()
    ok_serving, how = serving(broker.address, ref) if alive else (False, "broker not running")
    stats = raw_stats(broker.address) if alive else {}
    rss1 = rss_mb(broker.pid)
    code = broker.stop()  # its shutdown is part of the test: a traceback then counts too
    log = broker.output()
    tracebacks = sum("Traceback" in line for line in log.splitlines())
    out(f"broker RSS: {rss0:.1f} MiB at start, {rss1 or 0:.1f} MiB at end" if rss0 else "broker RSS: unknown")
    out(f"broker alive at the end: {alive}; serving: {ok_serving} ({how}); exit status on SIGTERM: {code}")
    out(f"broker log lines with 'Traceback': {tracebacks}")
    for k, v in stats.items():
        if k in ("op", "v", "id", "processes"):
            continue
        if k == "models":
            v = {m: {kk: vv for kk, vv in d.items() if kk in ("requests", "replies", "errors")} for m, d in v.items()}
        out(f"broker stats {k}: {v}")
    for p in t.problems[:20]:
        out(f"problem: {p}")
    if len(t.problems) > 20:
        out(f"problem: ... and {len(t.problems) - 20} more")
    failed = (t.mismatched or t.failed or not alive or not ok_serving or code != 0 or tracebacks or t.twice
              or any("undecodable" in p or "harness error" in p or "still running" in p for p in t.problems)
              or sent < a.count)
    summary = {"sent": sent, "checked": t.checked, "mismatched": t.mismatched, "failed": t.failed,
               "no_reply": dict(t.no_reply), "twice": dict(t.twice), "late": dict(t.late), "alive": alive,
               "serving": ok_serving, "exit_status": code, "tracebacks": tracebacks, "rss_mb": (rss0, rss1),
               "problems": t.problems, "stats": stats}
    if tracebacks:
        ends = Counter(last_exceptions(log))
        out("exceptions ending the tracebacks: " + "; ".join(f"{k[:160]} x{v}" for k, v in ends.most_common(8)))
        first = log.index("Traceback")
        start = log.rfind("\n", 0, log.rfind("\n", 0, first)) + 1  # from the log line before it
        out("first traceback in the broker log:\n" + log[start:start + 2500])
    out("fuzz: " + ("FAIL" if failed else "PASS"))
    return (1 if failed else 0), summary


def main(argv: Optional[list[str]] = None) -> int:
    return run_command(run, argv)


if __name__ == "__main__":
    sys.exit(main())
