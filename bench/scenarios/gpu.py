"""GPU rows: on one GPU, the demo `resnet` (the product's demo model, declared as the comparison
declares it) served by tgw with one CUDA worker, once per `workers.cuda_host_memory` mode, beside
the in-process floor of that very program on that GPU and the seed design (Flask +
torch.jit.load under gunicorn) on it, each at c=64 with one row per request; and a host-to-device
copy of one max batch from the three kinds of host memory a worker can copy from. bench/README.md
("GPU rows") says what each row and ratio means.

Without a CUDA device (and without --device cpu) it prints "no CUDA device" and exits 0. With
--device cpu the same rows run on the CPU, without the copy rows and the host-memory modes: a
check of the plumbing, not a measurement. The exit status is 1 when a row failed or saw a failed
request, or a broker did not stop cleanly; targets missed are reported, not failed.

    tgw-bench gpu [--device cuda:0] [--quick] [--json FILE] [--concurrency 64]
        [--duration S] [--warmup S] [--floor-seconds S] [--copies N] [--flask-workers N] [--procs N]
        [--keep]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import numpy as np

from tgw.bench.harness import report, subset
from tgw.bench.harness.baselines import measure_floor
from tgw.bench.harness.comparison import Scenario, Servers
from tgw.bench.harness.loadgen import LoadSpec
from tgw.bench.harness.measure import measure
from tgw.bench.harness.targets import TgwTarget, tensor_bytes
from tgw.testing.child import BrokerProc, finish_run
from tgw.testing.demo import demo_models, tgw_config

NAME = "gpu"
HELP = "on one GPU: the demo resnet in-process, tgw per cuda_host_memory mode, Flask; host -> device copies"
MODEL = "resnet"
HOST_MEMORY = ("register", "staging", "pageable")   # workers.cuda_host_memory's values: a tgw row each
MODES = {  # seconds measured per served row, its warm-up, seconds per floor batch size, timed copies
    "quick": {"duration": 3.0, "warmup": 1.0, "floor_seconds": 1.0, "copies": 200},
    "full": {"duration": 10.0, "warmup": 2.0, "floor_seconds": 3.0, "copies": 1000},
}


def floor_rows(model: dict[str, Any], device: str, seconds: float, log: Callable[[str], None],
               out: dict[str, Any]) -> None:
    """Into `out`: the program the worker serves (load_in_process), called on `device` at its max
    batch size (and 1 and max/4), synchronized per call: inputs already on the device, and (on a
    GPU) copied from the host per call with the outputs copied back."""
    for key, from_host in (("floor", False), ("floor_from_host", True)):
        if from_host and device == "cpu":
            continue
        try:
            res = measure_floor(model, seconds, 1, module="served", device=device, from_host=from_host)
        except Exception as exc:  # noqa: BLE001 - recorded, the other rows still run
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"{key} FAILED: {out[key]['error']}")
            continue
        top = res["runs"][-1]   # sorted by batch size: the last is max_batch_size
        out[key] = {"rows_per_s": top["samples_per_s"], "throughput_rps": top["samples_per_s"], "batch": top["batch"],
                    "latency_ms": top["latency_ms"], "requests_failed": 0, "raw": res}
        log(f"{key}: {top['samples_per_s']:,.0f} rows/s at batch {top['batch']} "
            f"(p50 {top['latency_ms']['p50']:.3f} ms per batch)")


def tgw_config_on(models: dict[str, Any], device: str, host_memory: Optional[str]) -> dict[str, Any]:
    """The comparison's tgw config for the one model, with one worker on `device`, no HTTP face,
    warmed at 1 and max rows, and workers.cuda_host_memory when given."""
    cfg = tgw_config(models, [MODEL], 1)
    cfg.pop("http", None)
    cfg["workers"]["devices"] = [device]
    if host_memory:
        cfg["workers"]["cuda_host_memory"] = host_memory
    m = cfg["models"][0]
    m["warmup_batch_sizes"] = sorted({1, m["max_batch_size"]})
    return cfg


def tgw_row(cfg: dict[str, Any], workdir: str, spec: LoadSpec, log: Callable[[str], None]) -> dict[str, Any]:
    """A broker of `cfg` started in `workdir`, loaded closed-loop through the load generator, stopped."""
    from tgw.client import Client
    from tgw.shm.segment import list_segments
    os.makedirs(workdir, exist_ok=True)
    broker = BrokerProc(cfg, workdir)
    try:
        broker.start(timeout=300)
    except Exception:  # it exited, or is not ready in time: stopped, then re-raised
        broker.stop()
        raise
    try:
        with Client(broker.address) as client:
            processes = client.stats()["processes"]
            row = measure(TgwTarget(broker.address, MODEL, timeout=60.0), spec, processes, stats=client.stats)
    finally:
        status = broker.stop(timeout=30)
        leftovers = list_segments(broker.pid)
    row["broker"] = {"exit_status": status, "shm_leftovers": leftovers, "workers": cfg["workers"]}
    if status != 0 or leftovers:
        log(f"tgw broker stop: exit status {status}, /dev/shm leftovers {leftovers}")
    return row


def tgw_rows(models: dict[str, Any], a, work: str, log: Callable[[str], None], rows: dict[str, Any]) -> None:
    """Into `rows`: "tgw[MODE]" -> row for each workers.cuda_host_memory mode (on a GPU), or one
    "tgw" row (on the CPU, where the key changes nothing)."""
    spec = LoadSpec("closed", a.concurrency, a.duration, a.warmup, a.procs)

    def one(mode: Optional[str]) -> dict[str, Any]:
        key = f"tgw[{mode}]" if mode else "tgw"
        log(f"{key}: a broker with one worker on {a.device}, {MODEL} c={a.concurrency}")
        try:
            r = tgw_row(tgw_config_on(models, a.device, mode), os.path.join(work, mode or "plain"), spec, log)
        except Exception as exc:  # noqa: BLE001 - recorded, the other rows still run
            log(f"{key} FAILED: {type(exc).__name__}: {str(exc)[:2000]}")
            return {"error": f"{type(exc).__name__}: {exc}"}
        log(f"{key}: {r['throughput_rps']:,.0f} req/s, p50 {report._f(r['latency_ms']['p50'], '{:.3f}')} ms, "
            f"p99 {report._f(r['latency_ms']['p99'], '{:.3f}')} ms, mean batch "
            f"{report._f((r.get('broker_stats') or {}).get('mean_batch_rows'), '{:.1f}')}, errors {r['errors']}")
        return r

    for mode in (a.host_memory if a.device.startswith("cuda") else [None]):
        rows[f"tgw[{mode}]" if mode else "tgw"] = one(mode)


def flask_row(models: dict[str, Any], a, work: str, log: Callable[[str], None]) -> dict[str, Any]:
    """The comparison's Flask+gunicorn row, its model on `a.device` in every gunicorn worker."""
    srv = Servers(a, work, {MODEL: {**models[MODEL], "device": a.device}}, [MODEL], log)
    try:
        srv.start("flask")
        return srv.row("flask", Scenario(MODEL, a.concurrency))
    finally:
        srv.stop()


# ---- ratios, table, outputs -------------------------------------------------------------------------

# ---- the CUDA side, each function run in a fresh interpreter (in_subprocess), so torch and CUDA
# stay out of the harness and its load generator: the device probe and the host -> device copies
# from pageable, registered and staged memory ----------------------------------------------------

def in_subprocess(function: str, *args: Any, timeout: float = 300) -> Any:
    """function(*args) of this module run by a fresh interpreter; its JSON result."""
    code = ("import json, sys; from tgw.bench.scenarios import gpu; "
            f"print(json.dumps(gpu.{function}(*json.loads(sys.argv[1]))))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{function} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def probe(device: str) -> dict[str, Any]:
    """torch's version, the CUDA it was built for, and whether `device` (cuda:N) exists."""
    import torch
    index = (torch.device(device).index or 0) if device.startswith("cuda") else None
    there = torch.cuda.is_available() and index is not None and index < torch.cuda.device_count()
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "device_there": there, "name": torch.cuda.get_device_name(index) if there else None}


def _timed(op: Callable[[], Any], iters: int, nbytes: int, device: str) -> dict[str, float]:
    """op() timed by CUDA events around it on the current stream (median and p99 over `iters`),
    and by the wall clock up to the end event's completion."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        op()
    torch.cuda.synchronize(device)
    us, wall = np.empty(iters), np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter()
        start.record()
        op()
        end.record()
        end.synchronize()
        wall[i] = (time.perf_counter() - t0) * 1e6
        us[i] = start.elapsed_time(end) * 1e3
    med = float(np.median(us))
    return {"us_per_batch": med, "gb_per_s": nbytes / med / 1e3, "p99_us": float(np.percentile(us, 99)),
            "wall_us": float(np.median(wall))}


def copy_rows(device: str, nbytes: int, iters: int) -> dict[str, Any]:
    """One max batch's input bytes copied host -> device from (i) pageable memory, a view of a POSIX
    shared-memory mapping as the worker's ring is; (ii) the same mapping page-locked with
    cudaHostRegister (unregistered after); (iii) a memcpy into a pinned staging tensor, then the
    copy. Each row: {us_per_batch, gb_per_s, p99_us, wall_us} or {"error"}; "fastest" names one."""
    import mmap

    import torch
    from tgw.shm.segment import Segment, new_name
    torch.cuda.set_device(device)
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    seg = Segment.create(new_name("gpubench"), size)
    try:
        out = {"bytes": nbytes, **_copies(seg.buf, size, nbytes, iters, device)}   # its views are gone then
    finally:
        try:
            seg.close()
        except BufferError:   # a view is still alive; the mapping goes with the process
            pass
        seg.unlink()
    rows = {k: out[k] for k in ("pageable", "registered", "staging") if "us_per_batch" in out.get(k, {})}
    out["fastest"] = min(rows, key=lambda k: rows[k]["us_per_batch"]) if rows else None
    return out


def _copies(buf: memoryview, size: int, nbytes: int, iters: int, device: str) -> dict[str, Any]:
    import torch
    out: dict[str, Any] = {}
    src = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))   # every page touched
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out["pageable"] = _timed(lambda: dst.copy_(src, non_blocking=True), iters, nbytes, device)
    try:
        cudart = torch.cuda.cudart()
        rc = int(cudart.cudaHostRegister(src.data_ptr(), size, 0))   # 0: cudaHostRegisterDefault
    except Exception as exc:  # noqa: BLE001 - reported in the row
        rc, out["registered"] = None, {"error": f"cudaHostRegister unavailable: {type(exc).__name__}: {exc}"}
    if rc == 0:
        try:
            out["registered"] = _timed(lambda: dst.copy_(src, non_blocking=True), iters, nbytes, device)
        finally:
            out["unregister_rc"] = int(cudart.cudaHostUnregister(src.data_ptr()))
    elif rc is not None:
        out["registered"] = {"error": f"cudaHostRegister returned {rc}"}
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def staged() -> None:
        pinned.copy_(src)
        dst.copy_(pinned, non_blocking=True)
    out["staging"] = _timed(staged, iters, nbytes, device)
    # its two parts apart: the memcpy into the staging tensor, and the copy from pinned memory
    out["staging"]["h2d_us"] = _timed(lambda: dst.copy_(pinned, non_blocking=True), iters, nbytes,
                                      device)["us_per_batch"]
    t0 = time.perf_counter()
    for _ in range(iters):
        pinned.copy_(src)
    out["staging"]["memcpy_us"] = (time.perf_counter() - t0) / iters * 1e6
    return out


# ---- the rows ---------------------------------------------------------------------------------------


# ---- the figures and the text: the ratios against their goals, the summary lines, the tables,
# what failed, the JSON file ---------------------------------------------------------------------

# ratio -> (its name in the summary, comparison, goal); each tgw row has its own
TARGETS = {"tgw_over_floor_throughput": ("tgw/floor rows/s", ">=", 0.85),
           "tgw_over_flask_throughput": ("tgw/Flask req/s", ">=", 3.4),
           "tgw_over_flask_p99": ("tgw/Flask p99", "<=", 0.25)}


def _value(row: Optional[dict[str, Any]], key: str) -> Optional[float]:
    if not row or "error" in row:
        return None
    return row["latency_ms"].get(key) if key in ("p50", "p99") else row.get(key)


def ratios(rows: dict[str, Any]) -> dict[str, dict[str, Optional[float]]]:
    """tgw row -> its ratios over the floors and over Flask."""
    def ratio(a: str, b: str, key: str) -> Optional[float]:
        x, y = _value(rows.get(a), key), _value(rows.get(b), key)
        return x / y if x is not None and y else None
    return {t: {"tgw_over_floor_throughput": ratio(t, "floor", "rows_per_s"),
                "tgw_over_floor_from_host_throughput": ratio(t, "floor_from_host", "rows_per_s"),
                "tgw_over_flask_throughput": ratio(t, "flask", "throughput_rps"),
                "tgw_over_flask_p50": ratio(t, "flask", "p50"),
                "tgw_over_flask_p99": ratio(t, "flask", "p99")}
            for t in rows if t.startswith("tgw")}


def met(name: str, value: Optional[float]) -> Optional[bool]:
    _, op, goal = TARGETS[name]
    return None if value is None else (value >= goal if op == ">=" else value <= goal)


def summary_lines(result: dict[str, Any]) -> list[str]:
    """One line per tgw row: its key ratios against their targets (what scripts/gpu-check.sh prints)."""
    lines = []
    for t, r in result["ratios"].items():
        parts = []
        for name, (label, op, goal) in TARGETS.items():
            ok = met(name, r[name])
            verdict = "-" if ok is None else "met" if ok else "MISSED"
            parts.append(f"{label} {report._f(r[name])} ({op} {goal:g}: {verdict})")
        lines.append(f"{t}: " + ", ".join(parts))
    return lines


def table(rows: dict[str, Any], concurrency: int) -> list[list[str]]:
    labels = {"floor": "in-process floor (inputs on the device)",
              "floor_from_host": "in-process floor (host -> device per batch)",
              "flask": "Flask+gunicorn"}
    out = [["row", "req/s", "rows/s", "p50 ms", "p99 ms", "batch", "errors"]]
    for key, row in rows.items():
        name = labels.get(key, "tgw native" + key[3:].replace("[", " ["))
        if key.startswith("floor"):
            name += ", one max batch per call"
        else:
            name = report.label("flask", row) if key == "flask" and "error" not in row else name
            name += f" c={concurrency}"
        if "error" in row:
            out.append([name, "-", "-", "-", "-", "-", row["error"].splitlines()[0][:60]])
            continue
        batch = row["batch"] if key.startswith("floor") else (row.get("broker_stats") or {}).get("mean_batch_rows")
        errs = ", ".join(f"{k} x {v}" for k, v in row.get("errors", {}).items()) or "0"
        out.append([name, report._f(row["throughput_rps"], "{:,.0f}"), report._f(row["rows_per_s"], "{:,.0f}"),
                    report._f(row["latency_ms"]["p50"], "{:.3f}"), report._f(row["latency_ms"]["p99"], "{:.3f}"),
                    report._f(batch, "{:.1f}"), errs])
    return out


def copy_table(copies: dict[str, Any]) -> list[list[str]]:
    labels = {"pageable": "pageable (a shared-memory mapping, as the ring)",
              "registered": "the same mapping after cudaHostRegister",
              "staging": "memcpy into pinned staging, then the copy"}
    out = [["host memory", "us/batch", "GB/s", "p99 us", "wall us"]]
    for key, label in labels.items():
        r = copies.get(key) or {"error": "not run"}
        if "error" in r:
            out.append([label, r["error"][:60], "-", "-", "-"])
        else:
            out.append([label + (f" ({r['memcpy_us']:.0f} + {r['h2d_us']:.0f} us)" if key == "staging" else ""),
                        *(f"{r[k]:.{d}f}" for k, d in (("us_per_batch", 1), ("gb_per_s", 2), ("p99_us", 1),
                                                       ("wall_us", 1)))])
    return out


def failed(result: dict[str, Any]) -> list[str]:
    """What makes the exit status 1: rows with an error or failed requests, unclean broker stops."""
    bad = [f"interrupted (exit {result['interrupted']}): the rows after the last one here were not run"] \
        if "interrupted" in result else []
    bad += [f"{k}: {r['error'].splitlines()[0]}" for k, r in result["rows"].items() if "error" in r]
    bad += [f"{k}: {r['requests_failed']} requests failed" for k, r in result["rows"].items()
            if "error" not in r and r.get("requests_failed")]
    bad += [f"{k}: served no request" for k, r in result["rows"].items()
            if "error" not in r and not k.startswith("floor") and not r.get("requests_ok")]
    bad += [f"{k}: broker exit status {r['broker']['exit_status']}, leftovers {r['broker']['shm_leftovers']}"
            for k, r in result["rows"].items() if "broker" in r
            and (r["broker"]["exit_status"] != 0 or r["broker"]["shm_leftovers"])]
    copies = result.get("copies") or {}
    bad += [f"copies: {copies['error'].splitlines()[0]}"] if "error" in copies else \
        [f"copy {k}: {copies[k]['error']}" for k in ("pageable", "registered", "staging")
         if "error" in copies.get(k, {})]
    return bad


def write(path: Optional[str], result: dict[str, Any]) -> None:
    if path:
        report.write_json(path, result)
        print(f"wrote {path}")


# ---- the command ---------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda:0", help="cuda:N, or cpu to run the plumbing on the CPU (default cuda:0)")
    p.add_argument("--quick", action="store_true", help="short rows: " + ", ".join(
        f"{k.replace('_', ' ')} {MODES['quick'][k]:g} (else {v:g})" for k, v in MODES["full"].items()))
    p.add_argument("--json", help="write every row, ratio and setting here")
    p.add_argument("--host-memory", type=subset(HOST_MEMORY), default=list(HOST_MEMORY),
                   help=f"a tgw row for each of these workers.cuda_host_memory values (default "
                        f"{','.join(HOST_MEMORY)}; on a CUDA device only)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight for the served rows (default 64)")
    p.add_argument("--duration", type=float, help="measured seconds per served row")
    p.add_argument("--warmup", type=float, help="warm-up seconds per served row")
    p.add_argument("--floor-seconds", type=float, help="seconds per floor batch size")
    p.add_argument("--copies", type=int, help="timed host-to-device copies per kind of host memory")
    p.add_argument("--flask-workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                   help="gunicorn sync workers, each with the model on the device (default: half the cores, <= 8)")
    p.add_argument("--procs", type=int, default=0, help="load generator processes (default: half the cores, 2..4)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (configs, logs, models)")


def run(a: argparse.Namespace) -> int:
    for k, v in MODES["quick" if a.quick else "full"].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    log = lambda msg: print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    t0 = time.monotonic()
    result: dict[str, Any] = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                              "command": a.command_line,
                              "device": a.device, "cuda": in_subprocess("probe", a.device), "machine": report.machine()}
    c = result["cuda"]
    log(f"torch {c['torch']}, CUDA {c['cuda']}, {c['device_count']} device(s)"
        + (f"; {a.device}: {c['name']}" if c["name"] else ""))
    if a.device != "cpu" and not c["device_there"]:
        print(f"no CUDA device ({a.device}): nothing measured; --device cpu runs the rows on the CPU", flush=True)
        result["skipped"] = f"no CUDA device {a.device}"
        write(a.json, result)
        return 0
    result["settings"] = {k: getattr(a, k) for k in ("quick", "host_memory", "concurrency", "duration", "warmup",
                                                     "floor_seconds", "copies", "flask_workers", "procs")}
    work = tempfile.mkdtemp(prefix="tgwg-", dir="/tmp")   # ipc paths must stay under 107 bytes
    rows: dict[str, Any] = {}
    try:
        models = demo_models(os.path.join(work, "models"))
        decl = models[MODEL]
        result["model"] = {MODEL: {k: decl[k] for k in ("inputs", "outputs", "max_batch_size")},
                           "request_bytes": tensor_bytes(decl["inputs"])}
        batch_bytes = tensor_bytes(decl["inputs"]) * decl["max_batch_size"]
        if a.device != "cpu":
            log(f"host -> device copies of one max batch ({batch_bytes:,} bytes), {a.copies} each")
            try:
                result["copies"] = in_subprocess("copy_rows", a.device, batch_bytes, a.copies)
            except Exception as exc:  # noqa: BLE001 - recorded, the other rows still run
                result["copies"] = {"error": f"{type(exc).__name__}: {exc}"}
                log(f"copies FAILED: {result['copies']['error']}")
        floor_rows(decl, a.device, a.floor_seconds, log, rows)
        tgw_rows(models, a, work, log, rows)
        log(f"Flask+gunicorn: {a.flask_workers} sync workers, the model on {a.device} in each")
        rows["flask"] = flask_row(models, a, work, log)
    except (KeyboardInterrupt, SystemExit) as exc:   # Ctrl-C, or SIGTERM (the cli's handler): the rows so far
        result["interrupted"] = 130 if isinstance(exc, KeyboardInterrupt) else \
            exc.code if isinstance(exc.code, int) else 143
        print("\ninterrupted: stopping every server this run started", file=sys.stderr)
    finally:
        finish_run(work, a.keep)
    result.update(rows=rows, ratios=ratios(rows), targets={k: f"{op} {goal:g}" for k, (_, op, goal) in TARGETS.items()},
                  wall_s=time.monotonic() - t0)
    result["summary"] = summary_lines(result)
    result["failed"] = failed(result)
    print("\n" + report.text_table(table(rows, a.concurrency), 1))
    if "copies" in result and "error" not in result["copies"]:
        cp = result["copies"]
        print(f"\nhost -> device, one max batch ({cp['bytes']:,} bytes); fastest: {cp['fastest']}")
        print(report.text_table(copy_table(cp), 1))
    print("\n" + "\n".join(result["summary"]))
    for line in result["failed"]:
        print(f"FAILED {line}")
    write(a.json, result)
    return result.get("interrupted") or (1 if result["failed"] else 0)
