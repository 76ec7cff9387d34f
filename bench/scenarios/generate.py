"""`tgw-bench generate`: streamed generation side by side in one run - the in-process floor (one
static batch), Flask + gunicorn streaming each request, tgw one-shot requests looping from the
client, LitServe with stream=True and tgw generate (Client and AsyncClient) - on the demo's GPT decoder, prompts of
seeded varied length, 64 outputs each, at 1, 16 and 64 concurrent streams; then the issue's goals
as ratios (bench/README.md, "Generation"). Writes bench/results/generate-<date>[-quick].json.
Exit status 0 when every row was filled without a failed request, 1 otherwise, 130 when
interrupted.

    tgw-bench generate --quick        # a tiny model, one request per stream: seconds, for the test
    tgw-bench generate                # the full run bench/results/generate-*.json holds
    tgw-bench generate --systems floor,generate --streams 1,64
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

from tgw.bench.harness import gen_drive, gen_faults, gen_model, report, subset
from tgw.bench.harness.gen_baselines import FlaskStreamServer, LitServeServer, litserve_missing
from tgw.testing.child import BrokerProc, exit_record, finish_run

NAME = "generate"
HELP = "streamed generation: floor, Flask streaming, tgw one-shot loops, LitServe, tgw generate"
SYSTEMS = ("floor", "flask", "oneshot", "litserve", "generate", "generate_async")
LABELS = {"floor": "(a) in-process floor", "flask": "(b) Flask+gunicorn stream", "oneshot": "(c) tgw one-shot loop",
          "litserve": "(d) LitServe stream", "generate": "(e) tgw generate",
          "generate_async": "(e) tgw generate, AsyncClient"}
GEN, ONESHOT = "gpt", "gpt-oneshot"
TGW = ("oneshot", "generate", "generate_async")   # the systems served by one tgw broker
STREAM_TIMEOUT_S = 120.0   # a generation's deadline: a lost stream fails its row instead of hanging the run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a tiny model, one request per stream (seconds)")
    p.add_argument("--systems", default=list(SYSTEMS), type=subset(SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all)")
    p.add_argument("--streams", default="1,16,64", help="concurrent streams per level (default 1,16,64)")
    p.add_argument("--workers", type=int, default=2,
                   help="tgw workers, gunicorn workers and LitServe workers, one torch thread each (default 2)")
    p.add_argument("--litserve-batch", type=int, default=64,
                   help="LitServe's max_batch_size (a static batch streamed to its end; default 64)")
    p.add_argument("--no-faults", action="store_true",
                   help="skip the fault and load rows (cancellation by four means, a flood against the slot "
                        "pool, a worker killed under load)")
    p.add_argument("--seed", type=int, default=1, help="weights and prompts (default 1)")
    p.add_argument("--out", help="folder for results/ (default: bench/ of the checkout, else .)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (weights, logs, sockets)")


def tgw_config(weights: str, module, workers: int, systems: list[str]) -> dict[str, Any]:
    """The broker of rows (c) and (e): the generator and the one-shot stage (those of them that
    `systems` runs) on `workers` CPU workers, one torch thread each."""
    cfg = module.cfg
    common = {"max_batch_size": 64, "max_queue": 4096, "timeout_ms": 600_000}
    models = [
        gen_model.generator_entry(GEN, weights, cfg, gen_faults.LONG),   # the cancel rows' long streams; the rest ask OUTPUTS
        {"name": ONESHOT, "versions": [{"version": "1", "handler": "tgw.bench.harness.gen_baselines:NextToken"}],
         "options": {"weights": weights},
         "inputs": [{"name": "tokens", "dtype": "int64", "shape": [cfg.max_len]},
                    {"name": "length", "dtype": "int64", "shape": []}],
         "outputs": [{"name": "token", "dtype": "int64", "shape": []}], **common}]
    # 64 streams on one AsyncClient share one connection's queue, one message per output per stream:
    # quick mode's tiny model outruns a busy reader past the default 1,000 (a slow reader is not measured here)
    return {"server": {"client_queue_messages": 100_000},
            "workers": {"devices": ["cpu"] * workers, "threads_per_worker": 1},
            "models": [m for m, s in zip(models, (("generate", "generate_async"), ("oneshot",)))
                       if set(s) & set(systems)]}


def per_stream(system: str, streams: int, quick: bool) -> int:
    """Requests each stream makes back to back at a level (the one-shot loop is slow: one)."""
    if quick or system == "oneshot":
        return 1
    return 4 if streams == 1 else 2


class Systems:
    """Starts each served system once, gives its Call, stops it by PID."""

    def __init__(self, a: argparse.Namespace, work: str, weights: str, module, plist: list[list[int]]):
        self.a, self.work, self.weights, self.module, self.plist = a, work, weights, module, plist
        self.call: Optional[gen_drive.Call] = None
        self.server: Any = None
        self.broker: Optional[BrokerProc] = None
        self.client = None

    def start(self, system: str) -> Callable[..., tuple[list, float]]:
        """The system started; its closed loop: loop(streams, per_stream, first_index) -> (Streams, wall)."""
        if system == "generate_async":
            self._broker()
            address = self.broker.address
            return lambda n, k, first=0: gen_drive.async_closed_loop(address, GEN, self.plist, n, k, gen_model.OUTPUTS,
                                                                     STREAM_TIMEOUT_S, first)
        self.call = call = self._call(system)
        return lambda n, k, first=0: gen_drive.closed_loop(call, self.plist, n, k, first)

    def _broker(self) -> None:
        if self.broker is None:
            from tgw.client import Client
            self.broker = BrokerProc(tgw_config(self.weights, self.module, self.a.workers, self.a.systems), self.work)
            self.client = Client(self.broker.start(timeout=300).address)

    def _call(self, system: str) -> gen_drive.Call:
        n = gen_model.OUTPUTS
        if system == "flask":
            self.server = FlaskStreamServer(self.weights, self.a.workers, self.work)
            return gen_drive.flask_call(self.server.port, n)
        if system == "litserve":
            missing = litserve_missing()
            if missing:
                raise RuntimeError(missing)
            self.server = LitServeServer(self.weights, self.a.workers, self.a.litserve_batch, self.work)
            return gen_drive.litserve_call(self.server.port, n)
        self._broker()
        if system == "oneshot":
            return gen_drive.oneshot_call(self.client, ONESHOT, self.module.cfg.max_len, n)
        return gen_drive.generate_call(self.client, GEN, n, timeout=STREAM_TIMEOUT_S)

    def processes(self, system: str) -> list[dict[str, Any]]:
        if system in TGW:
            return self.client.stats().get("processes", []) if self.client is not None else []
        return self.server.processes if self.server is not None else []

    def stop(self, system: str) -> dict[str, Any]:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if system in TGW and not [s for s in SYSTEMS[SYSTEMS.index(system) + 1:] if s in TGW and s in self.a.systems]:
            return self.stop_broker()   # the last tgw system of the run
        return {}

    def stop_broker(self) -> dict[str, Any]:
        if self.broker is None:
            return {}
        if self.client is not None:
            self.client.close()
        info = exit_record(self.broker)
        self.broker = self.client = None
        return info


def _f(v: Optional[float], fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def measure_system(systems: Systems, system: str, levels: list[int], plist: list[list[int]], quick: bool,
                   check: Callable[[list[int], list[int]], str], log: Callable[[str], None]) -> dict[str, Any]:
    """One system's rows: each level's closed loop and, for a streaming system, the newcomer."""
    try:
        loop = systems.start(system)
    except Exception as exc:  # noqa: BLE001 - recorded; the other systems still run
        log(f"{LABELS[system]} could not start: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {"levels": {}}
    try:
        loop(min(2, max(levels)), 1, len(plist) // 2)   # warm-up
        for n in levels:
            k = per_stream(system, n, quick)
            streams, wall = loop(n, k)
            row = out["levels"][n] = gen_drive.summary(streams, wall, gen_model.OUTPUTS, check)
            row["per_stream"] = k
            if system.startswith("generate"):
                row["resumed"] = sum(getattr(s.final, "resumed", 0) or 0 for s in streams)
            log(f"{LABELS[system]} x{n}: {_f(row['outputs_per_s'], ',.0f')} outputs/s, first output p50 "
                f"{_f(row['ttfo_ms']['p50'], '.1f')} ms, between p99 {_f(row['between_ms']['p99'], '.2f')} ms"
                + (f", {row['requests_failed']} failed {row['errors']}" if row["requests_failed"] else "")
                + (f", {row['outputs_wrong']} WRONG: {row['first_wrong']}" if row["outputs_wrong"] else ""))
        out["processes"] = systems.processes(system)
        if system not in ("oneshot", "generate_async") and max(levels) > 1:
            others = max(levels) - 1
            out["newcomer"] = nc = gen_drive.newcomer(systems.call, plist, others, 8, 120 if quick else 600)
            log(f"{LABELS[system]} newcomer beside {others}: " + (nc.get("error") or
                f"first output after {nc['ttfo_ms']:.1f} ms, {nc['steps_waited']:g} steps of the others"))
    except Exception as exc:  # noqa: BLE001
        log(f"{LABELS[system]} FAILED: {type(exc).__name__}: {exc}")
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
    finally:
        server = systems.stop(system)
        if server:
            out["server"] = server
    return out


FAULTS = {  # (full, quick)
    "cancel": ({"total": 1000, "wave": 100, "deadline_s": 0.5}, {"total": 40, "wave": 20, "deadline_s": 0.05}),
    # sent at about twice what 64 slots serve: the queue (256) fills and the excess is refused
    "flood": ({"total": 10_000, "rate": 1000.0, "max_outputs": 8}, {"total": 300, "rate": 1000.0, "max_outputs": 4}),
    "kill": ({"streams": 32, "every_s": 5.0, "duration_s": 30.0}, {"streams": 4, "every_s": 3.0, "duration_s": 4.0}),
}


def fault_rows(a: argparse.Namespace, work: str, weights: str, module, plist: list[list[int]], check,
               log: Callable[[str], None]) -> dict[str, Any]:
    """The cancel and kill rows on a broker like (e)'s, the flood on one of one worker whose queue
    is bounded; each row bounded, its broker stopped by PID."""
    from tgw.client import Client
    pick = 1 if a.quick else 0
    out: dict[str, Any] = {}
    cfg = tgw_config(weights, module, a.workers, ["generate"])
    flood_cfg = tgw_config(weights, module, 1, ["generate"])
    flood_cfg["models"][0]["max_queue"] = 256
    for rows, config in ((("cancel", "kill"), cfg), (("flood",), flood_cfg)):
        d = os.path.join(work, rows[0])
        os.makedirs(d)
        broker = BrokerProc(config, d)
        try:
            broker.start(timeout=300)
            with Client(broker.address) as c:
                def workers() -> list[int]:
                    return [w["pid"] for w in c.status()["workers"] if w.get("pid")]
                for row in rows:
                    opts = FAULTS[row][pick]
                    t0 = time.monotonic()
                    try:
                        if row == "cancel":
                            r = gen_faults.cancel_row(broker.address, GEN, plist, check, log=log, **opts)
                        elif row == "kill":
                            r = gen_faults.kill_row(broker.address, GEN, workers, plist, check, log=log, **opts)
                        else:
                            r = gen_faults.flood_row(broker.address, GEN, lambda: {"broker": broker.pid, "worker": (
                                workers() or [0])[0]}, plist, log=log, **opts)
                    except Exception as exc:  # noqa: BLE001 - recorded; the other rows still run
                        r = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
                    out[row] = r
                    log(f"{row} row ({time.monotonic() - t0:.0f} s): " + ", ".join(
                        f"{k} {v}" for k, v in r.items() if k not in ("traceback", "rss_mib_first", "rss_mib_last")))
        except Exception as exc:  # noqa: BLE001
            for row in rows:
                out.setdefault(row, {"error": f"{type(exc).__name__}: {exc}"})
        finally:
            out.setdefault("servers", {})[rows[0]] = exit_record(broker)
    return out


def goals(res: dict[str, Any], levels: list[int]) -> list[dict[str, Any]]:
    """The issue's "Measured" rows that this run can judge: value, target, met."""
    floor, rows = res.get("floor", {}), res["systems"]
    hi, lo = max(levels), min(levels)

    def ops(system: str, n: int) -> Optional[float]:
        if system == "floor":
            return (floor.get("levels") or {}).get(n, {}).get("outputs_per_s")
        if system == "split":
            return ((floor.get("split") or {}).get("levels") or {}).get(n, {}).get("outputs_per_s")
        return ((rows.get(system) or {}).get("levels") or {}).get(n, {}).get("outputs_per_s")

    def goal(name: str, value: Optional[float], target: Optional[float], higher: bool, unit: str = "") -> dict:
        met = None if value is None or target is None else (value >= target if higher else value <= target)
        return {"goal": name, "value": value, "target": target, "met": met, "unit": unit}

    out = []
    fl = (floor.get("levels") or {})
    mid = 16 if 16 in levels else hi
    for e_sys, tag in (("generate", "(e)"), ("generate_async", "(e async)")):
        if e_sys not in rows:
            continue
        for other, want in (("flask", 5.0), ("litserve", 2.0), ("floor", 0.8), ("split", 0.8)):
            e, o = ops(e_sys, hi), ops(other, hi)
            if other == "split":
                if o is not None:
                    out.append(goal(f"outputs/s at {hi} streams, {tag}/(a) on {floor['split']['procs']} processes",
                                    e / o if e and o else None, want, True, "x"))
                continue
            out.append(goal(f"outputs/s at {hi} streams, {tag}/{LABELS[other][:3]}", e / o if e and o else None, want,
                            True, "x"))
        e, o = ops(e_sys, lo), ops("floor", lo)
        out.append(goal(f"outputs/s at {lo} stream(s), {tag}/(a)", e / o if e and o else None, 0.9, True, "x"))
        gen = (rows.get(e_sys) or {}).get("levels") or {}
        if mid in gen and mid in fl:
            target = floor["prefill_one_ms"] + 2 * fl[mid]["step_ms"]
            out.append(goal(f"{tag} time to first output p50 at {mid} streams <= one prefill + 2 steps",
                            gen[mid]["ttfo_ms"]["p50"], target, False, "ms"))
        nc = (rows.get(e_sys) or {}).get("newcomer") or {}
        if "steps_waited" in nc:
            out.append(goal(f"{tag} newcomer beside {nc['others']}: steps from its call to its first output",
                            nc["steps_waited"], 2, False, "steps"))
        if hi in gen and hi in fl:
            out.append(goal(f"{tag} time between outputs p99 at {hi} streams <= 1.5 x the floor's step",
                            gen[hi]["between_ms"]["p99"], 1.5 * fl[hi]["step_ms"], False, "ms"))
    return out


def tables(res: dict[str, Any], levels: list[int]) -> str:
    head = ["system"] + [f"outputs/s x{n}" for n in levels] + \
        [f"first p50 ms x{n}" for n in levels] + [f"between p99 ms x{levels[-1]}"]
    body = [head]
    fl = res.get("floor", {}).get("levels") or {}
    if fl:
        body.append([LABELS["floor"]] + [f"{fl[n]['outputs_per_s']:,.0f}" if n in fl else "-" for n in levels] +
                    ["-"] * len(levels) + [f"(step {fl[levels[-1]]['step_ms']:.2f})" if levels[-1] in fl else "-"])
    sp = (res.get("floor", {}).get("split") or {}).get("levels") or {}
    if sp:
        body.append([f"(a) floor on {res['floor']['split']['procs']} processes"] +
                    [f"{sp[n]['outputs_per_s']:,.0f}" if n in sp else "-" for n in levels] + ["-"] * (len(levels) + 1))
    for system, row in res["systems"].items():
        lv = row.get("levels") or {}
        if not lv:
            body.append([LABELS[system], (row.get("error") or "not run")[:60]] + [""] * (2 * len(levels)))
            continue
        body.append([LABELS[system]] + [f"{lv[n]['outputs_per_s']:,.0f}" if n in lv else "-" for n in levels] +
                    [f"{lv[n]['ttfo_ms']['p50']:.1f}" if n in lv and lv[n]['ttfo_ms']['p50'] is not None else "-"
                     for n in levels] +
                    [f"{lv[levels[-1]]['between_ms']['p99']:.2f}" if levels[-1] in lv and
                     lv[levels[-1]]['between_ms']['p99'] is not None else "-"])
    g = [["goal", "value", "target", "met"]] + [
        [x["goal"], "-" if x["value"] is None else f"{x['value']:.2f} {x['unit']}",
         "-" if x["target"] is None else f"{x['target']:.2f} {x['unit']}",
         {True: "yes", False: "NO", None: "-"}[x["met"]]] for x in res["goals"]]
    return report.text_table(body) + "\n\n" + report.text_table(g)


def floor(res: dict[str, Any], weights: str, levels: list[int], plist: list[list[int]], quick: bool, workers: int,
          log: Callable[[str], None]) -> None:
    """A round of the floor into res["floor"]: per level the best of this round and the one before
    (the most outputs/s, the shortest prefill and step), each round kept in "rounds"; and the same
    sequences dealt among `workers` processes at once ("split": what the served systems' worker
    count buys)."""
    try:
        new = gen_model.measure_floor(weights, levels, plist, 1 if quick else 3)
    except Exception as exc:  # noqa: BLE001 - recorded; the served systems still run
        res.setdefault("floor", {"error": f"{type(exc).__name__}: {exc}"})
        log(f"{LABELS['floor']} FAILED: {type(exc).__name__}: {exc}")
        return
    fl = new["levels"]
    log(f"{LABELS['floor']}: " + ", ".join(f"x{n} {fl[n]['outputs_per_s']:,.0f} outputs/s (step "
                                           f"{fl[n]['step_ms']:.2f} ms)" for n in levels)
        + f"; one prompt's prefill {new['prefill_one_ms']:.2f} ms")
    try:
        split = gen_model.measure_split_floor(weights, levels, plist, 1 if quick else 3, workers)
        new["split"] = split
        log(f"{LABELS['floor']} on {workers} processes: " + ", ".join(
            f"x{n} {lv['outputs_per_s']:,.0f} outputs/s" for n, lv in split["levels"].items()))
    except Exception as exc:  # noqa: BLE001 - recorded
        new["split"] = {"error": f"{type(exc).__name__}: {exc}"}
    old = res.get("floor")
    if not old or "levels" not in old:
        res["floor"] = {**copy.deepcopy(new), "rounds": [new]}   # the best-of figures; each round as measured
        return
    old["rounds"].append(new)
    old["prefill_one_ms"] = min(old["prefill_one_ms"], new["prefill_one_ms"])
    if "levels" in new["split"]:
        if "levels" not in old.get("split", {}):
            old["split"] = new["split"]
        for n, lv in new["split"]["levels"].items():
            o = old["split"]["levels"][n]
            o.update(outputs_per_s=max(o["outputs_per_s"], lv["outputs_per_s"]), wall_s=min(o["wall_s"], lv["wall_s"]))
    for n, lv in fl.items():
        o = old["levels"][n]
        o.update(outputs_per_s=max(o["outputs_per_s"], lv["outputs_per_s"]), wall_s=min(o["wall_s"], lv["wall_s"]),
                 prefill_ms=min(o["prefill_ms"], lv["prefill_ms"]), step_ms=min(o["step_ms"], lv["step_ms"]))


def run(a: argparse.Namespace) -> int:
    levels = gen_model.stream_levels(a.streams)
    if levels is None:
        return 2
    for flag, value in (("--workers", a.workers), ("--litserve-batch", a.litserve_batch)):
        if value < 1:
            print(f"{flag} must be at least 1, got {value}", file=sys.stderr)
            return 2
    log = lambda msg: print(f"[generate {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    dims = gen_model.QUICK_DIMS if a.quick else gen_model.DIMS
    custom = set(a.systems) != set(SYSTEMS) or levels != [1, 16, 64] or a.workers != 2
    mode = "custom" if custom else ("quick" if a.quick else "full")
    work = tempfile.mkdtemp(prefix="tgwg-", dir="/tmp")   # short: ipc paths must fit 107 bytes
    t0, date = time.monotonic(), datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    res: dict[str, Any] = {"scenario": NAME, "mode": mode, "date": date, "command": a.command_line,
                           "machine": report.machine(), "systems": {}}
    try:
        weights = gen_model.save_weights(dims, a.seed, os.path.join(work, "gpt.pt"))
        module = gen_model.load(weights)
        plist = gen_model.prompts(256, a.seed, dims["vocab"])
        check = gen_model.checker(module)
        res["settings"] = {
            "model": {**dims, "params": sum(p.numel() for p in module.parameters())},
            "outputs_per_request": gen_model.OUTPUTS, "prompt_lengths": list(gen_model.PROMPT_LENGTHS),
            "streams": levels, "workers": a.workers, "torch_threads_per_worker": 1, "sampling": "greedy",
            "per_stream": {s: {n: per_stream(s, n, a.quick) for n in levels} for s in a.systems if s != "floor"},
            "floor": "one process, one torch thread: every prompt prefilled in one padded call, then 63 batched steps",
            "flask": f"gunicorn {a.workers} sync workers x 1 torch thread, one sequence at a time per worker, "
                     "chunked text/plain, one line per output",
            "oneshot": "tgw stage NextToken (the whole sequence, no cache), one Client.infer per output",
            "litserve": f"LitAPI(stream=True, max_batch_size={a.litserve_batch}, batch_timeout=0.005), "
                        f"workers_per_device={a.workers} on cpu x 1 torch thread; a static batch runs to its end",
            "generate": f"Client.generate, a thread per stream, {a.workers} tgw workers x 1 torch thread, 64 slots "
                        "each, greedy",
            "generate_async": "AsyncClient.generate, a task per stream on one event loop, the same broker"}
        log(f"{mode} mode: model {res['settings']['model']}, streams {levels}, work dir {work}")
        if "floor" in a.systems:
            floor(res, weights, levels, plist, a.quick, a.workers, log)
        systems = Systems(a, work, weights, module, plist)
        for system in [s for s in SYSTEMS if s in a.systems and s != "floor"]:
            res["systems"][system] = measure_system(systems, system, levels, plist, a.quick, check, log)
        systems.stop_broker()
        if "floor" in a.systems and not a.quick:   # a second round after the systems: the box is noisy
            floor(res, weights, levels, plist, a.quick, a.workers, log)
        if ("generate" in a.systems or "generate_async" in a.systems) and not a.no_faults:
            res["faults"] = fault_rows(a, work, weights, module, plist, check, log)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every server this run started", file=sys.stderr)
        return 130
    finally:
        finish_run(work, a.keep)
    res["goals"] = goals(res, levels)
    report.conclude(res, "generate", a.out, date, mode, t0, tables(res, levels))
    # LitServe not installed is recorded, not a failure: it is an optional extra
    complete = "error" not in res.get("floor", {}) and all(
        "error" not in row and all(not lv["requests_failed"] and not lv["outputs_wrong"] for lv in row["levels"].values())
        for s, row in res["systems"].items() if not (s == "litserve" and litserve_missing()))
    return 0 if complete else 1
