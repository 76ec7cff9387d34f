"""`tgw-bench torchserve`: the same two `.mar` archives (made by the real torch-model-archiver:
TorchServe's built-in text classifier, and a custom BaseHandler decoding JPEG with Pillow)
served by the real TorchServe 0.12.0 and by tgw's TorchServe face (`tgw-broker start
--model-store DIR`), both POSTed the same body on `/predictions/{model}` by one closed loop at
c=1/16/64: req/s, p50/p99, the front process's CPU (TorchServe's JVM, tgw's broker) and the
workers' per request, beside the in-process floor (the archive's handler
alone, loaded by the `ts` package as TorchServe's worker loads it, Service.predict in a loop:
harness/ts_floor.py). The issue's goals: tgw >= 2x TorchServe's req/s at c=16 and c=64, and
tgw's p50 <= TorchServe's at c=1, for each archive. Before the load each system's answer to the
body is checked (the text one against the archive's own files computed in-process, the image one
against TorchServe's). Writes bench/results/torchserve-<date>[-quick].json. Exit status 0 when
every row ran without a failed request and every answer was right, 1 otherwise; a system that
cannot run here (no java, no torchserve) is recorded as skipped with the reason, not a failure.

    tgw-bench torchserve --quick       # concurrency 1,4, one second a row: the test's mode
    tgw-bench torchserve               # the full run bench/results/torchserve-*.json holds
    tgw-bench torchserve --archives image --concurrency 16 --duration 20
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import urllib.request
from typing import Any, Optional

from tgw.bench.harness import report, subset
from tgw.bench.harness.loadgen import LoadSpec
from tgw.bench.harness.measure import loadgen_drive, measure
from tgw.bench.harness.targets import HttpTarget
from tgw.bench.harness.torchserve_server import TorchServe, missing
from tgw.bench.harness.ts_floor import run_floor
from tgw.bench.harness.tgw_model_store import TgwModelStore
from tgw.bench.harness.wrk import WRK_INSTALL_HINT, wrk_drive
from tgw.testing import mar_archives

NAME = "torchserve"
HELP = "the same .mar archives on TorchServe and on tgw's /predictions: req/s, p50/p99, CPU per request"
SYSTEMS = ("torchserve", "tgw")
ARCHIVES = ("text", "image")
MODELS = {"text": "textclf", "image": "imgclf"}
CONTENT_TYPE = {"text": "text/plain", "image": "image/jpeg"}
RATIO_TARGET = 2.0   # tgw's req/s over TorchServe's at c=16 and c=64
TOLERANCE = 1e-4     # answers compared as probabilities


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="concurrency 1,4, one second a row (the test's mode)")
    p.add_argument("--systems", default=list(SYSTEMS), type=subset(SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)} (default: both)")
    p.add_argument("--archives", default=list(ARCHIVES), type=subset(ARCHIVES),
                   help="text (the built-in text_classifier), image (the custom Pillow handler); default both")
    p.add_argument("--concurrency", default=None, help="closed-loop levels (default 1,16,64; quick 1,4)")
    p.add_argument("--duration", type=float, default=None, help="seconds measured a row (default 10, quick 1)")
    p.add_argument("--warmup", type=float, default=None, help="seconds of load before each row (default 2, quick 1)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds over every archive and level, the two systems back to back (default 2, quick 1)")
    p.add_argument("--workers", type=int, default=2, help="workers per model on each system (default 2)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="the image archive's batch_size on both (default 8; the built-in text handler takes 1)")
    p.add_argument("--batch-delay-ms", type=int, default=5,
                   help="the image archive's max_batch_delay on both, ms (default 5)")
    p.add_argument("--python-generator", action="store_true",
                   help="load with loadgen.py's keep-alive sockets even when wrk is installed")
    p.add_argument("--out", help="folder for results/ (default: bench/ of the checkout, else .)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (archives, logs)")


def levels(text: Optional[str], quick: bool) -> Optional[list[int]]:
    try:
        out = [int(x) for x in (text or ("1,4" if quick else "1,16,64")).split(",") if x]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        print(f"--concurrency: positive integers separated by commas, got {text!r}", file=sys.stderr)
        return None
    return out


def registrations(archives: list[str], batch: int, delay_ms: int) -> dict[str, dict[str, Any]]:
    """{model: {mar, batch_size, max_batch_delay_ms}}, the same on both systems."""
    return {MODELS[a]: {"mar": f"{MODELS[a]}.mar", "batch_size": batch if a == "image" else 1,
                        "max_batch_delay_ms": delay_ms if a == "image" else 0} for a in archives}


def bodies(work: str) -> dict[str, str]:
    """Each archive's request body in a file (wrk and the Python generator post the file)."""
    out = {}
    for a, data in (("text", mar_archives.SENTENCES[0].encode()), ("image", mar_archives.sample_image("JPEG", 64))):
        out[a] = os.path.join(work, f"body-{a}")
        with open(out[a], "wb") as f:
            f.write(data)
    return out


def predict(url: str, model: str, body_path: str, content_type: str) -> Any:
    with open(body_path, "rb") as f:
        req = urllib.request.Request(f"{url}/predictions/{model}", data=f.read(),
                                     headers={"Content-Type": content_type})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def close(a: Any, b: Any) -> bool:
    """Two answers (dicts class -> probability) equal as TorchServe would print them, to TOLERANCE."""
    return (isinstance(a, dict) and isinstance(b, dict) and list(a) == list(b)
            and all(abs(float(a[k]) - float(b[k])) <= TOLERANCE for k in a))


def front_cpu_us(row: dict[str, Any]) -> tuple[Optional[float], Optional[float]]:
    """(front, workers) CPU µs per request: the broker or TorchServe's JVM; every other process."""
    front = [p["cpu_us_per_request"] for p in row.get("server_processes", []) if p["role"] in ("broker", "frontend")]
    work = [p["cpu_us_per_request"] for p in row.get("server_processes", []) if p["role"] not in ("broker", "frontend")]
    f = None if not front or None in front else sum(front)
    w = None if not work or None in work else sum(work)
    return f, w


def ratio(res: dict[str, Any], arch: str, n: int, key: str) -> Optional[float]:
    """tgw's figure over TorchServe's at level n: the median over rounds of each round's ratio
    (in a round the two ran back to back, so a ratio pairs rows the shared box's load met alike)."""
    def rounds(system: str) -> list[dict]:
        return ((((res["rows"].get(system) or {}).get(arch) or {}).get(str(n))) or {}).get("rounds") or []
    mine, ref = rounds("tgw"), rounds("torchserve")
    pairs = [a[key] / b[key] for a, b in zip(mine, ref)
             if a.get(key) and b.get(key) and not a["requests_failed"] and not b["requests_failed"]]
    return float(statistics.median(pairs)) if pairs and len(mine) == len(ref) else None


def goals(res: dict[str, Any], archives: list[str], lv: list[int]) -> list[dict[str, Any]]:
    out = []
    for a in archives:
        for n in [x for x in lv if x >= 16]:
            r = ratio(res, a, n, "throughput_rps")
            out.append({"goal": f"{a}: req/s at c={n}, tgw/TorchServe (median of the rounds' ratios)", "value": r,
                        "target": RATIO_TARGET, "unit": "x", "met": None if r is None else r >= RATIO_TARGET})
        if 1 in lv:
            r = ratio(res, a, 1, "p50_ms")
            out.append({"goal": f"{a}: p50 at c=1, tgw/TorchServe (median of the rounds' ratios)", "value": r,
                        "target": 1.0, "unit": "x", "met": None if r is None else r <= 1.0})
    return out


def cpu_per_request(res: dict[str, Any], archives: list[str], lv: list[int]) -> dict[str, Any]:
    """Each system's server CPU per request (front + workers, µs; each level's kept row) and
    TorchServe's over tgw's: what a request costs, which other sessions' load on a shared box
    moves less than req/s. Reported beside the goals, not one of them."""
    out: dict[str, Any] = {}
    for a in archives:
        for n in lv:
            fl = (res.get("floor") or {}).get(a) or {}
            cell = {"floor": fl.get("cpu_us_per_request")}
            for system in SYSTEMS:
                r = ((res["rows"].get(system) or {}).get(a) or {}).get(str(n))
                if r and "error" not in r:
                    f, w = front_cpu_us(r)
                    cell[system] = None if f is None or w is None else f + w
            if cell.get("torchserve") and cell.get("tgw"):
                cell["torchserve/tgw"] = cell["torchserve"] / cell["tgw"]
            if cell.get("torchserve") and cell["floor"]:   # the most any server could gain, CPU-bound
                cell["torchserve/floor"] = cell["torchserve"] / cell["floor"]
            out.setdefault(a, {})[str(n)] = cell
    return out


def tables(res: dict[str, Any], archives: list[str], lv: list[int]) -> str:
    body = [["archive", "c", "system", "req/s", "p50 ms", "p99 ms", "front us/req", "workers us/req", "others' cores",
             "failed"]]
    for a in archives:
        for n in lv:
            for system in SYSTEMS:
                sys_rows = res["rows"].get(system)
                if sys_rows is None:
                    continue
                r = (sys_rows.get(a) or {}).get(str(n))
                if r is None or "error" in r:
                    body.append([a, str(n), system, (r or {}).get("error", sys_rows.get("skipped", "not run"))[:60],
                                 "", "", "", "", "", ""])
                    continue
                f, w = front_cpu_us(r)
                lat = r["latency_ms"]
                body.append([a, str(n), system, f"{r['throughput_rps']:,.0f}", _f(lat["p50"], ".2f"),
                             _f(lat["p99"], ".2f"), _f(f, ".0f"), _f(w, ".0f"),
                             _f(r["machine"].get("other_cpu_cores"), ".2f"), str(r["requests_failed"])])
    g = [["goal", "value", "target", "met"]] + [
        [x["goal"], _f(x["value"], ".2f"), f"{x['target']:.2f}", {True: "yes", False: "NO", None: "-"}[x["met"]]]
        for x in res["goals"]]
    cpu = [["archive", "c", "TorchServe CPU us/req", "tgw CPU us/req", "floor us/req", "TorchServe/tgw",
            "TorchServe/floor"]] + [
        [a, n, _f(c.get("torchserve"), ".0f"), _f(c.get("tgw"), ".0f"), _f(c.get("floor"), ".0f"),
         _f(c.get("torchserve/tgw"), ".2f"), _f(c.get("torchserve/floor"), ".2f")]
        for a, levels_ in res.get("cpu_per_request", {}).items() for n, c in levels_.items()]
    return report.text_table(body) + "\n\n" + report.text_table(g) + "\n\n" + report.text_table(cpu)


def _f(v: Optional[float], fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def serve(system: str, work: str, store: str, regs: dict[str, dict], workers: int):
    """The started server of `system`: .url, .processes(), .stop()."""
    if system == "torchserve":
        return TorchServe(os.path.join(work, "ts"), store, regs, workers).start()
    return TgwModelStore(os.path.join(work, "tgw"), store, regs, workers).start()


def start_system(system: str, a: argparse.Namespace, res: dict, work: str, store: str, regs: dict,
                 body: dict[str, str], log):
    """The system's server started and its answer to each archive's body recorded; None (the
    error recorded) when it did not start or answer."""
    rows = res["rows"][system]
    server = None
    try:
        t0 = time.monotonic()
        server = serve(system, work, store, regs, a.workers)
        rows["start_s"] = time.monotonic() - t0
        rows["processes"] = server.processes()
        log(f"{system} ready at {server.url} in {rows['start_s']:.1f} s, processes {rows['processes']}")
        # each model as the server's management API describes it: the batching both read from the archive
        rows["describe"] = {MODELS[x]: server.describe(MODELS[x]) for x in a.archives}
        for arch in a.archives:
            answer = predict(server.url, MODELS[arch], body[arch], CONTENT_TYPE[arch])
            res["answers"].setdefault(arch, {})[system] = answer
        return server
    except Exception as exc:  # noqa: BLE001 - recorded; the other system still runs
        rows["error"] = f"{type(exc).__name__}: {exc}"
        rows["traceback"] = traceback.format_exc()
        log(f"{system} FAILED: {rows['error']}")
        if server is not None:
            rows["server"] = server.stop()
        return None


def one_row(system: str, server, arch: str, n: int, body: dict[str, str], spec: dict, drive, log) -> dict:
    model = MODELS[arch]
    target = HttpTarget("127.0.0.1", int(server.url.rsplit(":", 1)[1]), f"/predictions/{model}", body[arch],
                        timeout=60.0, label=f"{system}-{arch}", model=model, content_type=CONTENT_TYPE[arch])
    try:
        row = measure(target, LoadSpec(level=n, **spec), server.processes(), drive=drive,
                      stats=getattr(server, "stats", None))   # tgw's: the batches its broker formed
    except Exception as exc:  # noqa: BLE001 - recorded; the other rows still run
        log(f"{system} {arch} c={n} FAILED: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    f, w = front_cpu_us(row)
    batch = (row.get("broker_stats") or {}).get("mean_batch_rows")
    log(f"{system} {arch} c={n}: {row['throughput_rps']:,.0f} req/s, p50 {_f(row['latency_ms']['p50'], '.2f')} "
        f"ms, p99 {_f(row['latency_ms']['p99'], '.2f')} ms, front {_f(f, '.0f')} us/req, workers "
        f"{_f(w, '.0f')} us/req, other processes {_f(row['machine']['other_cpu_cores'], '.2f')} cores"
        + (f", mean batch {batch:.1f}" if batch else "")
        + (f", {row['requests_failed']} failed" if row["requests_failed"] else ""))
    return row


def keep(old: Optional[dict], new: dict) -> dict:
    """A level's row over rounds: the one with more req/s, every round's figures in "rounds"."""
    summary = ({"error": new["error"]} if "error" in new else
               {"throughput_rps": new["throughput_rps"], "p50_ms": new["latency_ms"]["p50"],
                "requests_failed": new["requests_failed"]})
    rounds = (old or {}).get("rounds", []) + [summary]
    if old is None or "error" in old or ("error" not in new and new["throughput_rps"] > old["throughput_rps"]):
        best = new
    else:
        best = old
    return {**best, "rounds": rounds}


def check_answers(res: dict[str, Any], store: str, archives: list[str]) -> None:
    """The text answer against the archive's files computed here; the image one, tgw's against TorchServe's."""
    checks = res["answer_checks"] = {}
    for arch in archives:
        got = res["answers"].get(arch, {})
        if arch == "text":
            ref = mar_archives.reference_text(os.path.join(store, f".{MODELS[arch]}-src"), mar_archives.SENTENCES[0])
            for system, ans in got.items():
                checks[f"{arch}/{system}"] = close(ans, ref)
        elif len(got) == 2:
            checks[f"{arch}/tgw=torchserve"] = close(got["tgw"], got["torchserve"])


def run(a: argparse.Namespace) -> int:
    lv = levels(a.concurrency, a.quick)
    if lv is None:
        return 2
    if a.workers < 1 or a.batch_size < 1 or a.batch_delay_ms < 0:
        print("--workers and --batch-size must be at least 1, --batch-delay-ms at least 0", file=sys.stderr)
        return 2
    rounds = a.rounds if a.rounds is not None else (1 if a.quick else 2)
    if rounds < 1:
        print("--rounds must be at least 1", file=sys.stderr)
        return 2
    duration = a.duration if a.duration is not None else (1.0 if a.quick else 10.0)
    warmup = a.warmup if a.warmup is not None else (1.0 if a.quick else 2.0)
    log = lambda msg: print(f"[torchserve {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    systems = [s for s in SYSTEMS if s in a.systems]
    archives = [x for x in ARCHIVES if x in a.archives]
    a.archives = archives
    custom = systems != list(SYSTEMS) or archives != list(ARCHIVES) or a.concurrency is not None \
        or a.duration is not None or a.warmup is not None or a.rounds is not None or a.workers != 2 or a.batch_size != 8 or a.batch_delay_ms != 5
    mode = "custom" if custom else ("quick" if a.quick else "full")
    wrk = None if a.python_generator else shutil.which("wrk")
    drive = functools.partial(wrk_drive, wrk) if wrk else functools.partial(loadgen_drive, kind="python-fallback")
    if not wrk and not a.python_generator:
        log(WRK_INSTALL_HINT)
    work = tempfile.mkdtemp(prefix="tgwts-", dir="/tmp")   # short: ipc paths must fit 107 bytes
    t0, date = time.monotonic(), datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    regs = registrations(archives, a.batch_size, a.batch_delay_ms)
    res: dict[str, Any] = {
        "scenario": NAME, "mode": mode, "date": date, "command": a.command_line, "machine": report.machine(),
        "settings": {"concurrency": lv, "rounds": rounds, "duration_s": duration, "warmup_s": warmup, "workers_per_model": a.workers,
                     "torch_threads_per_worker": 1, "registrations": regs,
                     "generator": f"wrk ({wrk})" if wrk else "python fallback (loadgen.py keep-alive sockets)",
                     "bodies": {"text": f"text/plain, {mar_archives.SENTENCES[0]!r}",
                                "image": "image/jpeg, 64x64 seeded noise (decoded and resized to 32x32 by the handler)"},
                     "order": "both servers up (one idle while the other is loaded); per round, per archive, per level the "
                              "two systems back to back, each round the other first; each row's best round kept, "
                              "a ratio is the median of the rounds' ratios",
                     "front_cpu": "user+system seconds of TorchServe's JVM or tgw's broker over the row / requests",
                     "box": "a shared 2-core machine: other sessions' processes ran meanwhile (each row's "
                            "machine.other_cpu_cores says how much); ratios are of one run"},
        "rows": {s: {} for s in systems}, "answers": {}}
    servers: dict[str, Any] = {}
    try:
        store = os.path.join(work, "store")
        if "text" in archives:
            mar_archives.text_archive(store, MODELS["text"], workers=a.workers)
        if "image" in archives:
            mar_archives.image_archive(store, MODELS["image"], batch_size=a.batch_size,
                                       max_batch_delay_ms=a.batch_delay_ms, workers=a.workers)
        body = bodies(work)
        res["floor"] = {}
        for arch in archives:   # the handler alone, in one process: before any server runs
            reg = regs[MODELS[arch]]
            try:
                res["floor"][arch] = run_floor(os.path.join(store, reg["mar"]), body[arch], CONTENT_TYPE[arch],
                                               reg["batch_size"], duration)
                log(f"floor {arch}: {res['floor'][arch]['cpu_us_per_request']:.0f} us/req CPU, batch "
                    f"{reg['batch_size']}, {res['floor'][arch]['requests_per_s']:,.0f} req/s in one process")
            except Exception as exc:  # noqa: BLE001 - recorded (no ts package): the servers still run
                res["floor"][arch] = {"error": f"{type(exc).__name__}: {exc}"}
                log(f"floor {arch} FAILED: {res['floor'][arch]['error']}")
        spec = {"duration": duration, "warmup": warmup, "procs": 1}
        for system in systems:
            why = missing() if system == "torchserve" else None
            if why:
                res["rows"][system]["skipped"] = why
                log(f"{system} skipped: {why}")
                continue
            server = start_system(system, a, res, work, store, regs, body, log)
            if server is not None:
                servers[system] = server
        check_answers(res, store, archives)
        for r in range(rounds):
            for arch in archives:
                for n in lv:
                    order = list(servers)[r % 2:] + list(servers)[:r % 2]   # each round the other first
                    for system in order:
                        rows = res["rows"][system].setdefault(arch, {})
                        rows[str(n)] = keep(rows.get(str(n)), one_row(system, servers[system], arch, n, body, spec,
                                                                      drive, log))
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every server this run started", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the archives could not be made: recorded
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()
        log(f"FAILED: {res['error']}")
    finally:
        for system, server in servers.items():
            res["rows"][system]["server"] = server.stop()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}", file=sys.stderr)
    res["goals"] = goals(res, archives, lv)
    res["cpu_per_request"] = cpu_per_request(res, archives, lv)
    report.conclude(res, NAME, a.out, date, mode, t0, tables(res, archives, lv))
    complete = "error" not in res and all(res.get("answer_checks", {}).values()) and all(
        "error" not in f for f in res.get("floor", {}).values()) and all(
        "error" not in rows and (rows.get("skipped") or all(
            "error" not in (rows.get(x) or {}).get(str(n), {"error": 1}) and not rows[x][str(n)]["requests_failed"]
            for x in archives for n in lv))
        for rows in res["rows"].values())
    return 0 if complete else 1
