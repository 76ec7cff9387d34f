"""Reports of profile_broker's profilers: py-spy's stacks by area, perf's split by thread and
library, cProfile's calls per request."""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
from typing import Any, Optional


AREAS = (
    ("reply: answer, outbox, send", ("FrontDoor.answer", "FrontDoor.reply", "FrontDoor.error", "Outbox.send")),
    ("completion: decode Done, rows", ("WorkerMessages.on_message",)),
    ("batching: pump, next_batch, stage, send", ("Broker.pump", "Broker.schedule")),
    ("intake: read, validate, admit, queue", ("FrontDoor.on_message",)),
    ("drain loop + recv_multipart", ("Pump.drain",)),
    ("gatekeeper thread (ZAP, monitor)", ("Gatekeeper.run",)),
    ("monitor, tick, stats", ("Lifecycle", "Broker.tick")),
)
ZMQ_CALLS = ("Socket.send", "Socket.recv", "Socket.recv_multipart", "Socket.get")


def read_stacks(path: str) -> dict[str, Any]:
    """py-spy's raw output ("func (file:line);... count" per line) -> own and inclusive samples per
    "func (dir/file)", samples per area, of which inside a pyzmq call (libzmq and its syscalls,
    the GIL released), samples in the event loop's own frame, and the total."""
    own, incl, per, in_zmq = (collections.Counter() for _ in range(4))
    loop = total = 0
    for line in open(path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        n = int(n)
        frames = [re.sub(r"\(([^()]*?)(?::\d+)?\)$", lambda m: f"({'/'.join(m[1].split('/')[-2:])})", f)
                  for f in stack.split(";")]
        funcs = [f.split(" (")[0] for f in frames]
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
        if funcs[-1] == "Runner.run":
            loop += n
            continue
        area = next((name for name, fns in AREAS for f in reversed(funcs) if f.startswith(fns)), "other")
        per[area] += n
        if funcs[-1] in ZMQ_CALLS:
            in_zmq[area] += n
    return {"own": own, "incl": incl, "areas": per, "in_zmq": in_zmq, "loop": loop, "total": total}


def cprofile_report(path: str, n: int, main_us: float, top: int) -> None:
    """The top functions of a cProfile dump by own time: % of the profiled time, µs per request
    (that share of the unprofiled main thread's CPU) and calls per request."""
    import pstats
    st = pstats.Stats(path).stats  # (file, line, name) -> (primitive calls, calls, tottime, cumtime, callers)
    total = sum(v[2] for v in st.values())
    print(f"\ncProfile (uvloop thread; {path}): {total / n * 1e6:.1f} us/request profiled (the "
          f"profiler's own cost inflates it) vs {main_us:.1f} unprofiled; us/request = share x {main_us:.1f}")

    def name(k) -> str:
        f, line, fn = k
        return fn if f == "~" else f"{fn} ({'/'.join(f.split('/')[-2:])}:{line})"
    for title, idx in (("own time", 2), ("inclusive time", 3)):
        print(f"top {top} by {title}:   share   us/req  calls/req")
        for k, v in sorted(st.items(), key=lambda kv: -kv[1][idx])[:top]:
            print(f"  {v[idx] / total:6.1%} {v[idx] / total * main_us:7.1f}  {v[1] / n:8.2f}  {name(k)}")


def report_perf(a: argparse.Namespace, data: str, total_us: float) -> Optional[float]:
    """perf's split by thread and library, and its top symbols; returns the µs per request of the
    Python threads' own work (the interpreter, libc, msgspec, lz4: not the kernel, libzmq, uvloop)."""
    python_us = None
    print(f"\nperf (on-CPU samples of every broker thread; {data}); us/request = share x the broker's "
          f"{total_us:.1f}")
    for title, keys in (("by thread and library", "comm,dso"), (f"top {a.top} symbols", "comm,dso,sym")):
        rep = subprocess.run([a.perf, "report", "-i", data, "--stdio", "--no-children", "-g", "none",
                              "--percent-limit", "0.3", "--sort", keys], capture_output=True, text=True)
        print(f"{title}:")
        for ln in [ln for ln in rep.stdout.splitlines() if ln.strip() and not ln.startswith("#")][:a.top]:
            pct, rest = float(ln.split("%")[0]), ln.split("%", 1)[1].split()
            print(f"  {pct:5.1f}% {pct / 100 * total_us:6.1f} us  {' '.join(rest)}")
            if keys == "comm,dso" and rest[0] == "tgw-broker" and not re.search(r"kernel|zmq|loop\.", rest[1]):
                python_us = (python_us or 0.0) + pct / 100 * total_us
    return python_us


def report_pyspy(a: argparse.Namespace, raw: str, scale: float, from_perf: bool) -> None:
    """The Python work by area (without the samples inside pyzmq calls and in the event loop's own
    frame: on a busy machine those count time spent runnable, waiting for a CPU), then the top
    functions by own and inclusive samples."""
    st = read_stacks(raw)
    work = {k: v - st["in_zmq"][k] for k, v in st["areas"].items()}
    busy = sum(work.values()) or 1
    print(f"\npy-spy: the Python work by area ({busy:,d} samples; left out {sum(st['in_zmq'].values()):,d} inside "
          f"pyzmq calls, {st['loop']:,d} in the event loop's frame); us/request = share x "
          + (f"perf's Python work, {scale:.1f}" if from_perf else f"the main thread's CPU, {scale:.1f} (no --perf)"))
    for name, k in sorted(work.items(), key=lambda kv: -kv[1]):
        print(f"  {k / busy:6.1%} {k / busy * scale:7.1f} us  {name}")
    for title in ("own", "incl"):
        print(f"top {a.top} by {title} samples (of {st['total']:,d}; {raw}):")
        for frame, k in st[title].most_common(a.top):
            print(f"  {k / st['total']:6.1%}  {frame}")
