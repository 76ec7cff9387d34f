"""The response cache (docs/CACHE.md), measured on the demo models: throughput and the broker's CPU
per request with the cache off and on, the same run, under a workload whose requests repeat an
input `--repeat` of the time (a hot set of `--hot` inputs; the others are new each time); then
`--distinct` distinct inputs to the mlp, pipelined, into a cache bounded by `--max-bytes`: the
cache's bytes and the broker's RSS at the start, every tenth of the way, and the end.

    python -m tgw.bench.cache_bench [--models mlp,resnet] [--clients 16] [--seconds 6] [--rounds 3]
        [--repeat 0.5] [--hot 64] [--distinct 1000000] [--max-bytes 4194304] [--window 256]
        [--out bench/results/cache-DATE.json]

Two brokers, one CPU worker each: first the memory run's, serving the mlp as `mlp-bounded`
(`--max-bytes`, `--entries`) alone, so its RSS is the cache's; then the throughput runs', serving
each demo model M of --models under two names, `M` (no cache) and `M-cached` (a cache that holds
a whole window). Off and on alternate `--rounds` times per model; each window follows a warm-up
of its own (`--warmup`). The callers run in this process (asyncio, one
AsyncClient), on the same CPUs as the broker and its worker.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import sys
import tempfile
import time

import numpy as np
import psutil

from tgw.bench.comparison import demo_models
from tgw.broker.child import BrokerProc
from tgw.client import AsyncClient, Client

def config(models: dict, names: list[str], bounded: dict | None = None) -> dict:
    """`names` without a cache and as NAME-cached; `bounded`: mlp-bounded's cache section."""
    def decl(name: str, base: str, cache: dict | None = None) -> dict:
        m = models[base]
        return {"name": name, "versions": [{"version": "1", "path": m["path"]}], "inputs": m["inputs"],
                "outputs": m["outputs"], "max_batch_size": m["max_batch_size"], "max_queue": 8192,
                "timeout_ms": 120000, **({"cache": cache} if cache else {})}
    whole = {"entries": 1 << 22, "max_bytes": 1 << 30}
    return {"workers": {"devices": ["cpu"], "threads_per_worker": 1}, "server": {"max_request_bytes": 64 << 20},
            "models": [d for n in names for d in (decl(n, n), decl(f"{n}-cached", n, whole))] +
            ([decl("mlp-bounded", "mlp", bounded)] if bounded else [])}


def fresh(k: int, shape: tuple) -> np.ndarray:
    """The k-th input never sent before (every element k: exact in float32 up to 2^24)."""
    return np.full((1, *shape), float(k), np.float32)


class Usage:
    """CPU seconds of the broker and of its workers since the last take()."""

    def __init__(self, broker_pid: int, worker_pids: list[int]):
        self.procs = [psutil.Process(broker_pid), *(psutil.Process(p) for p in worker_pids)]
        self.last = self._now()

    def _now(self) -> list[float]:
        return [sum(p.cpu_times()[:2]) for p in self.procs]

    def take(self) -> tuple[float, float]:
        now = self._now()
        used = [b - a for a, b in zip(self.last, now)]
        self.last = now
        return used[0], sum(used[1:])


async def closed_loop(ac: AsyncClient, model: str, name: str, clients: int, seconds: float, hot: list,
                      repeat: float, fresh_from: int, seed: int) -> tuple[int, list[float], int]:
    """`clients` callers, one request at a time each, for `seconds`: (requests, latencies in
    seconds, the next fresh input number)."""
    stop_at = time.perf_counter() + seconds
    latencies: list[float] = []
    counter, shape = [fresh_from], hot[0].shape[1:]

    async def caller(i: int) -> None:
        rng = np.random.default_rng(seed * 1000 + i)
        while time.perf_counter() < stop_at:
            if rng.random() < repeat:
                x = hot[int(rng.integers(len(hot)))]
            else:
                x, counter[0] = fresh(counter[0], shape), counter[0] + 1
            t0 = time.perf_counter()
            await ac.infer(model, {name: x})
            latencies.append(time.perf_counter() - t0)
    await asyncio.gather(*(caller(i) for i in range(clients)))
    return len(latencies), latencies, counter[0]


def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)) * 1000, 3) if values else 0.0


async def throughput(address: str, a: argparse.Namespace, models: dict, usage: Usage) -> list[dict]:
    rows, next_fresh = [], 10_000_000   # fresh numbers of their own: none of the memory run's
    async with AsyncClient(address) as ac:
        for base in a.models.split(","):
            decl = models[base]["inputs"][0]
            hot = [np.random.default_rng(k).standard_normal((1, *decl["shape"]), dtype=np.float32)
                   for k in range(a.hot)]
            for r in range(a.rounds):
                for mode, model in (("off", base), ("on", f"{base}-cached")):
                    row, next_fresh = await window(ac, a, usage, model, decl["name"], hot, next_fresh, r)
                    rows.append({"base": base, "round": r, "mode": mode, **row})
                    print(json.dumps(rows[-1]), flush=True)
    return rows


async def window(ac: AsyncClient, a: argparse.Namespace, usage: Usage, model: str, name: str, hot: list,
                 next_fresh: int, r: int) -> tuple[dict, int]:
    """One measured window of `model` after its warm-up: (its row, the next fresh input number)."""
    _, _, next_fresh = await closed_loop(ac, model, name, a.clients, a.warmup, hot, a.repeat, next_fresh, r)
    before = (await ac.status())["models"][model]["cache"]
    usage.take()
    t0 = time.perf_counter()
    n, lat, next_fresh = await closed_loop(ac, model, name, a.clients, a.seconds, hot, a.repeat, next_fresh, 100 + r)
    wall = time.perf_counter() - t0
    broker_s, workers_s = usage.take()
    after = (await ac.status())["models"][model]["cache"]
    row = {"model": model, "requests": n, "wall_s": round(wall, 3), "req_per_s": round(n / wall, 1),
           "broker_cpu_s": round(broker_s, 3), "broker_cpu_us_per_request": round(broker_s / n * 1e6, 2),
           "workers_cpu_us_per_request": round(workers_s / n * 1e6, 2), "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)}
    if after is not None:
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        row.update(hits=hits, misses=misses, hit_ratio=round(hits / max(1, hits + misses), 4))
    return row, next_fresh


def summary(rows: list[dict]) -> dict:
    """Per model: each figure's median over the rounds (a round disturbed by another load on the
    box moves a mean, not a median), off and on, and on / off."""
    out: dict = {}
    for base in dict.fromkeys(r["base"] for r in rows):
        def median(mode: str, key: str) -> float:
            return float(np.median([r[key] for r in rows if r["base"] == base and r["mode"] == mode]))
        fig = out[base] = {}
        for key in ("req_per_s", "broker_cpu_us_per_request", "workers_cpu_us_per_request", "p50_ms", "p99_ms"):
            off, on = median("off", key), median("on", key)
            fig[key] = {"off": round(off, 2), "on": round(on, 2), "on_over_off": round(on / off, 3) if off else None}
        fig["hit_ratio_on"] = round(median("on", "hit_ratio"), 4)
    return out


async def memory(address: str, broker_pid: int, a: argparse.Namespace) -> dict:
    """--distinct distinct inputs, --window in flight, into mlp-bounded; samples every tenth."""
    broker = psutil.Process(broker_pid)
    marks = sorted({int(a.distinct * k / 10) for k in range(11)})
    samples, failed = [], 0
    t0 = time.perf_counter()
    async with AsyncClient(address) as ac:
        async def sample(sent: int) -> None:
            cache = (await ac.status())["models"]["mlp-bounded"]["cache"]
            samples.append({"sent": sent, "s": round(time.perf_counter() - t0, 1),
                            "broker_rss": broker.memory_info().rss,
                            "cache_bytes": cache["bytes"], "cache_entries": cache["entries"],
                            "evictions": cache["evictions"], "misses": cache["misses"], "hits": cache["hits"]})
            print(json.dumps(samples[-1]), flush=True)

        room = asyncio.Semaphore(a.window)

        async def one(k: int) -> None:
            nonlocal failed
            try:
                await ac.infer("mlp-bounded", {"x": fresh(k, (256,))})
            except Exception:   # noqa: BLE001 - counted; the run goes on
                failed += 1
            finally:
                room.release()
        tasks: set = set()
        await sample(0)
        for k in range(a.distinct):
            await room.acquire()
            t = asyncio.ensure_future(one(k))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            if k + 1 in marks:
                await asyncio.gather(*list(tasks))   # what was sent is answered (and kept) at each mark
                await sample(k + 1)
    wall = time.perf_counter() - t0
    start, middle, end = samples[0], samples[len(samples) // 2], samples[-1]
    return {"distinct": a.distinct, "window": a.window, "max_bytes": a.max_bytes, "entries_bound": a.entries,
            "failed": failed, "wall_s": round(wall, 1), "req_per_s": round(a.distinct / wall, 1),
            "start": start, "middle": middle, "end": end, "samples": samples,
            "cache_bytes_max": max(s["cache_bytes"] for s in samples),
            "broker_rss_growth_start_to_middle": middle["broker_rss"] - start["broker_rss"],
            "broker_rss_growth_middle_to_end": end["broker_rss"] - middle["broker_rss"],
            # what each kept answer costs the broker beyond its counted bytes, from the first half
            "rss_per_entry_bytes": round((middle["broker_rss"] - start["broker_rss"])
                                         / max(1, middle["cache_entries"]))}


def served(cfg: dict, work: str, run):
    """run(broker) on a broker of its own; the broker stopped however it ends (its exit status checked)."""
    b = BrokerProc(cfg, tempfile.mkdtemp(prefix="b-", dir=work)).start(timeout=180)
    try:
        return run(b)
    finally:
        code = b.stop()
        if code != 0:
            raise RuntimeError(f"the broker exited {code}:\n{b.output()[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tgw.bench.cache_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,resnet", help="demo models of the throughput runs")
    ap.add_argument("--clients", type=int, default=16, help="concurrent callers of the throughput runs")
    ap.add_argument("--seconds", type=float, default=6.0, help="each measured window")
    ap.add_argument("--warmup", type=float, default=1.5, help="before each window, not measured")
    ap.add_argument("--rounds", type=int, default=3, help="off/on alternations")
    ap.add_argument("--repeat", type=float, default=0.5, help="share of requests that repeat a hot input")
    ap.add_argument("--hot", type=int, default=64, help="the hot inputs repeated")
    ap.add_argument("--distinct", type=int, default=1_000_000, help="distinct inputs of the memory run (0: none)")
    ap.add_argument("--max-bytes", type=int, default=4 << 20, help="the memory run's cache bound (bytes)")
    ap.add_argument("--entries", type=int, default=1 << 20, help="the memory run's entry bound")
    ap.add_argument("--window", type=int, default=256, help="requests in flight in the memory run")
    ap.add_argument("--out", default=f"bench/results/cache-{datetime.date.today()}.json")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tgwcb-", dir="/tmp") as work:
        models = demo_models(os.path.join(work, "models"))

        def measure_throughput(b: BrokerProc) -> list[dict]:
            with Client(b.address) as c:
                workers = [w["pid"] for w in c.status()["workers"]]
            return asyncio.run(throughput(b.address, a, models, Usage(b.pid, workers)))
        section = {"entries": a.entries, "max_bytes": a.max_bytes}   # a broker of its own: its RSS is the cache's
        mem = served(config(models, [], section), work, lambda b: asyncio.run(memory(b.address, b.pid, a))) \
            if a.distinct else None
        rows = served(config(models, a.models.split(",")), work, measure_throughput)
    result = {"command": "python -m tgw.bench.cache_bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "cpus": os.cpu_count(),
              "load_average_at_end": os.getloadavg(), "throughput": {"summary": summary(rows), "rows": rows},
              "memory": mem}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({"summary": result["throughput"]["summary"],
                      "memory": {k: v for k, v in (mem or {}).items() if k != "samples"}}, indent=1))
    bounded = mem is None or (not mem["failed"] and mem["cache_bytes_max"] <= a.max_bytes)
    return 0 if bounded else 1


if __name__ == "__main__":
    sys.exit(main())
