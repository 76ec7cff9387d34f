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

    python -m tgw.bench.gpu_bench [--device cuda:0] [--quick] [--json FILE] [--concurrency 64]
        [--duration S] [--warmup S] [--floor-seconds S] [--copies N] [--flask-workers N] [--procs N]
        [--keep]
"""
from __future__ import annotations

import datetime
import os
import signal
import sys
import tempfile
import time
from typing import Any, Callable, Optional

from tgw.bench import gpu_probe, report, selfhosted
from tgw.bench.gpu_report import TARGETS, copy_table, failed, ratios, summary_lines, table, write
from tgw.bench.baselines import measure_floor
from tgw.broker.child import BrokerProc, finish_run
from tgw.bench.comparison import Scenario, Servers, demo_models, tgw_config
from tgw.bench.loadgen import LoadSpec
from tgw.bench.measure import measure
from tgw.bench.selfhosted import parser as make_parser, subset
from tgw.bench.targets import TgwTarget, tensor_bytes

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

def run(argv: Optional[list[str]] = None) -> tuple[int, dict[str, Any]]:
    p = make_parser("python -m tgw.bench.gpu_bench", __doc__)
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
    a = p.parse_args(argv)
    for k, v in MODES["quick" if a.quick else "full"].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    log = lambda msg: print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    t0 = time.monotonic()
    result: dict[str, Any] = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                              "command": " ".join(["python -m tgw.bench.gpu_bench", *(argv or sys.argv[1:])]),
                              "device": a.device, "cuda": gpu_probe.in_subprocess("probe", a.device), "machine": report.machine()}
    c = result["cuda"]
    log(f"torch {c['torch']}, CUDA {c['cuda']}, {c['device_count']} device(s)"
        + (f"; {a.device}: {c['name']}" if c["name"] else ""))
    if a.device != "cpu" and not c["device_there"]:
        print(f"no CUDA device ({a.device}): nothing measured; --device cpu runs the rows on the CPU", flush=True)
        result["skipped"] = f"no CUDA device {a.device}"
        write(a.json, result)
        return 0, result
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
                result["copies"] = gpu_probe.in_subprocess("copy_rows", a.device, batch_bytes, a.copies)
            except Exception as exc:  # noqa: BLE001 - recorded, the other rows still run
                result["copies"] = {"error": f"{type(exc).__name__}: {exc}"}
                log(f"copies FAILED: {result['copies']['error']}")
        floor_rows(decl, a.device, a.floor_seconds, log, rows)
        tgw_rows(models, a, work, log, rows)
        log(f"Flask+gunicorn: {a.flask_workers} sync workers, the model on {a.device} in each")
        rows["flask"] = flask_row(models, a, work, log)
    except (KeyboardInterrupt, SystemExit) as exc:   # Ctrl-C, or SIGTERM (main's handler): the rows so far
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
    return result.get("interrupted") or (1 if result["failed"] else 0), result


def main(argv: Optional[list[str]] = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: every server is stopped by PID
    return selfhosted.main(run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
