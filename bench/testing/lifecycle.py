"""Model lifecycle scenarios against a running broker, each returning its figures.

* swap: closed-loop callers on one model while its version is swapped v1 -> v2 -> ...; every
  reply's version is checked against its outputs (version k adds k) and, per caller thread,
  the version may only move forward.
* canary: n requests over a 90/10 split (observed shares), then routing keys (each key on one
  version).
* unload_rss: a large version loaded beside and unloaded; the worker's RSS before the load,
  after it, and after the unload, as the worker reported them.
* residency: on-demand models under a budget that fits fewer of them, requested round robin;
  evictions in order, loads, the worker's model bytes against its budget, cold-request latency.

Also the models they serve (version k of `m` returns x + k, so every reply names its version) and
`control`, one control request. tests/process/test_model_ops.py runs the scenarios and checks
their rules; the retired `tgw-bench lifecycle` ran them at full size (bench/results/RETIRED.md).
"""
from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np

from tgw.broker.cli.ask import ask
from tgw.client import Client
from tgw.shm.errors import TgwError
from tgw.shm.wire import PROTOCOL_VERSION, LoadVersion, UnloadVersion

WIDTH = 4   # the scenario models take x [batch, 4] and return x + k


def save_add_model(path: str, k: float, pad_floats: int = 0) -> str:
    """A TorchScript model y = x + k; `pad_floats` zeros it carries make it large (4 bytes each)."""
    import torch

    class AddK(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("k", torch.tensor([float(k)]))
            self.register_buffer("pad", torch.zeros(max(1, pad_floats)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.k + self.pad[:1]

    torch.jit.save(torch.jit.script(AddK()), path)
    return path


def model_decl(name: str, versions: list[tuple[str, str]], **extra) -> dict:
    """A config entry for an add model: versions as (version, path)."""
    return {"name": name, "versions": [{"version": v, "path": p} for v, p in versions],
            "inputs": [{"name": "x", "dtype": "float32", "shape": [WIDTH]}],
            "outputs": [{"name": "y", "dtype": "float32", "shape": [WIDTH]}], "max_batch_size": 16, **extra}


def control(address: str, msg, timeout_s: float = 300.0):
    """One control request (LoadVersion, SetTraffic, ...) to the broker at `address`; its reply."""
    msg.v = PROTOCOL_VERSION
    return ask(address, msg, timeout_s)


def version_of(x: np.ndarray, y: np.ndarray) -> int:
    return int(round(float(y[0, 0] - x[0, 0])))


# ---- swap ------------------------------------------------------------------------------------

def swap(address: str, model: str, new_versions: list[tuple[str, str]], concurrency: int = 32,
         duration_s: float = 30.0, per_phase: int = 0) -> dict:
    """Closed loop for `duration_s`; the swaps are spread evenly over its middle, each also
    after at least `per_phase` replies since the previous one (so every version serves)."""
    stop = threading.Event()
    results = [Counter() for _ in range(concurrency)]
    problems: list[str] = []

    def caller(i: int) -> None:
        tally, last = results[i], 0
        x = np.full((1, WIDTH), float(i), np.float32)
        with Client(address) as c:
            while not stop.is_set():
                try:
                    y = c.infer(model, {"x": x}, timeout=10.0)["y"]
                except TgwError as err:
                    tally[f"error {err.code.value}"] += 1
                    continue
                k = version_of(x, y)
                tally["ok"] += 1
                tally[f"version {k}"] += 1
                if k < last:
                    problems.append(f"caller {i}: version {k} after {last}")
                last = max(last, k)

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(concurrency)]
    start = time.monotonic()
    for t in threads:
        t.start()
    swaps = []
    gap = duration_s / (len(new_versions) + 1)
    replies = lambda: sum(r["ok"] for r in results)  # noqa: E731
    mark = 0
    for n, (version, path) in enumerate(new_versions, 1):
        _wait_until(start + gap * n, lambda: replies() >= mark + per_phase)
        mark = replies()
        t0 = time.monotonic()
        reply = control(address, LoadVersion(v=0, model=model, version=version, path=path))
        swaps.append({"version": version, "seconds": round(time.monotonic() - t0, 3), "message": reply.message,
                      "events": reply.details.get("events", [])})
    _wait_until(start + duration_s, lambda: replies() >= mark + per_phase)
    stop.set()
    for t in threads:
        t.join(60)
    total = sum(results, Counter())
    errors = {k[6:]: v for k, v in total.items() if k.startswith("error ")}
    return {"concurrency": concurrency, "seconds": round(time.monotonic() - start, 1), "requests": sum(
        v for k, v in total.items() if k == "ok" or k.startswith("error ")), "ok": total["ok"],
        "failed": sum(errors.values()), "errors": errors,
        "by_version": {k[8:]: v for k, v in sorted(total.items()) if k.startswith("version ")},
        "backward": problems[:10], "backward_count": len(problems), "swaps": swaps}


def _wait_until(t: float, also=lambda: True, bound_s: float = 120.0) -> None:
    """Until the clock reaches t and `also()` holds (given up `bound_s` past t)."""
    while time.monotonic() < t or (not also() and time.monotonic() < t + bound_s):
        time.sleep(min(max(t - time.monotonic(), 0.01), 0.1))


# ---- canary ----------------------------------------------------------------------------------

def canary(address: str, model: str, n: int = 20_000, keys: int = 500, threads: int = 4) -> dict:
    """n requests naming no version (shares by version), then `keys` routing keys 4 times each."""
    counts: Counter = Counter()
    lock = threading.Lock()

    def run(share: int) -> None:
        local = Counter()
        x = np.zeros((1, WIDTH), np.float32)
        with Client(address) as c:
            for _ in range(share):
                local[version_of(x, c.infer(model, {"x": x})["y"])] += 1
        with lock:
            counts.update(local)

    pool = [threading.Thread(target=run, args=(n // threads + (i < n % threads),)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seen: dict[str, set] = {}
    x = np.zeros((1, WIDTH), np.float32)
    with Client(address) as c:
        for _ in range(4):
            for k in range(keys):
                key = f"user-{k}"
                seen.setdefault(key, set()).add(version_of(x, c.infer(model, {"x": x}, routing_key=key)["y"]))
    key_versions = Counter(next(iter(v)) for v in seen.values() if len(v) == 1)
    return {"requests": n, "by_version": dict(sorted(counts.items())),
            "share": {v: round(100 * c / n, 2) for v, c in sorted(counts.items())},
            "keys": keys, "keys_on_two_versions": sum(len(v) > 1 for v in seen.values()),
            "keys_by_version": dict(sorted(key_versions.items()))}


# ---- unload RSS ------------------------------------------------------------------------------

def unload_rss(address: str, model: str, version: str, path: str) -> dict:
    """Load `version` beside (weight 0), unload it; the worker's own RSS figures."""
    loaded = control(address, LoadVersion(v=0, model=model, version=version, path=path, weight=0))
    unloaded = control(address, UnloadVersion(v=0, model=model, version=version))
    load = next(e for e in loaded.details["events"] if e["event"] == "load")
    unload = next(e for e in unloaded.details["events"] if e["event"] == "unload")
    before, after_load, after_unload = load["rss_before"], load["rss_after"], unload["rss_after"]
    return {"model_bytes": load["bytes"], "rss_before_load": before, "rss_after_load": after_load,
            "rss_after_unload": after_unload, "load_ms": load["ms"],
            "unload_vs_before_pct": round(100 * (after_unload - before) / before, 2)}


# ---- residency -------------------------------------------------------------------------------

def residency(address: str, models: list[str], rounds: int = 4, timeout_s: float = 30.0) -> dict:
    """Round robin over `models`, one request at a time; what the broker loaded and evicted."""
    x = np.zeros((1, WIDTH), np.float32)
    cold, warm, failed, over, over_fp = [], [], Counter(), [], []
    events: dict[int, dict] = {}   # seq -> event: the broker keeps only its recent ones
    with Client(address) as c:
        since = max((e["seq"] for e in c.status()["events"]), default=0)   # this call's events only
        for round_ in range(rounds):
            for m in models:
                t0 = time.perf_counter()
                try:
                    c.infer(m, {"x": x}, timeout=timeout_s)
                except TgwError as err:
                    failed[err.code.value] += 1
                    continue
                ms = (time.perf_counter() - t0) * 1000
                status = c.status()
                loads = sum(e["event"] == "load" for e in events.values())
                events.update((e["seq"], e) for e in status["events"] if e["seq"] > since)
                (cold if sum(e["event"] == "load" for e in events.values()) > loads else warm).append(ms)
                for w in status["workers"]:
                    if w["budget"] is not None and w["model_bytes"] > w["budget"]:
                        over.append(w["model_bytes"] - w["budget"])
                    held = sum(fp["bytes"] for fp in w.get("footprints", {}).values())   # as measured
                    if w["budget"] is not None and held > w["budget"]:
                        over_fp.append({"round": round_, "model": m, "over": held - w["budget"]})
    ordered = [events[k] for k in sorted(events)]
    return {"requests": rounds * len(models), "failed": dict(failed),
            "load_ms": _summary([e["ms"] for e in ordered if e["event"] == "load"]),
            "loads": [e["model"] for e in ordered if e["event"] == "load"],
            "evictions": [e["model"] for e in ordered if e["event"] == "evict"],
            "cold_ms": _summary(cold), "warm_ms": _summary(warm), "over_budget_bytes": over,
            "over_budget_footprint": over_fp}


def _summary(ms: list[float]) -> dict:
    if not ms:
        return {"n": 0}
    s = sorted(ms)
    return {"n": len(s), "p50": round(s[len(s) // 2], 2), "max": round(s[-1], 2)}
