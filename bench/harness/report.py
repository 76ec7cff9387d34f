"""Every output of the bench: `tgw-bench load`'s text, the comparison's tables, RESULTS.md
sections and JSON; the PNG plots are plots.py's."""
from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
from importlib import metadata
from typing import Any, Iterable, Optional

import numpy as np
import psutil

SYSTEMS = ("in-process", "transport", "tgw", "tgw_http", "tgw_http_bin", "tgw_grpc", "tgw_grpc_stream", "flask")
LABELS = {"in-process": "in-process floor", "transport": "transport floor (pyzmq echo)",
          "tgw": "tgw native", "tgw_http": "tgw HTTP", "tgw_http_bin": "tgw HTTP binary",
          "tgw_grpc": "tgw gRPC", "tgw_grpc_stream": "tgw gRPC stream", "flask": "Flask+gunicorn"}
TGW_SYSTEMS = ("tgw", "tgw_http", "tgw_http_bin", "tgw_grpc", "tgw_grpc_stream")   # rows served by the one tgw broker of a run
HTTP_SYSTEMS = ("tgw_http", "tgw_http_bin", "flask")  # rows loaded by the HTTP generator (wrk or its fallback)
LATENCY_KEYS = (("p50", "p50"), ("p90", "p90"), ("p99", "p99"), ("p99_9", "p99.9"))


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def label(system: str, row: dict[str, Any]) -> str:
    """The system's name; HTTP rows add the generator that loaded them (wrk or python-fallback)."""
    kind = (row.get("generator") or {}).get("kind")
    return LABELS[system] + (f" ({kind})" if system in HTTP_SYSTEMS and kind else "")


def format_summary(s: dict[str, Any]) -> str:
    lat, gen = s["latency_ms"], s["generator"]
    what = f"concurrency {s['level']:g}" if s["mode"] == "closed" else f"rate {s['level']:g} req/s (Poisson)"
    lines = [
        f"{s.get('model', s['target'])}: {what}, batch {s['batch']}, "
        f"{s['duration_s']:g}s measured after {s['warmup_s']:g}s warm-up",
        f"  throughput   {s['throughput_rps']:,.1f} req/s ({s['rows_per_s']:,.1f} rows/s), "
        f"{s['requests_ok']:,d} ok, {s['requests_failed']:,d} failed",
        "  latency ms   " + "  ".join(f"{name} {_f(lat[k], '{:.3f}')}" for k, name in (*LATENCY_KEYS, ("max", "max"))),
    ]
    if "send_lag_ms" in s:
        lag = s["send_lag_ms"]
        lines.append(f"  send lag ms  p50 {_f(lag['p50'], '{:.3f}')}  p99 {_f(lag['p99'], '{:.3f}')} "
                     f"(scheduled -> sent; counted in latency)")
    if s["errors"]:
        lines.append("  errors       " + ", ".join(f"{k} {v}" for k, v in s["errors"].items()))
        lines += [f"    {k}: {msg}" for k, msg in s["error_messages"].items()]
    if "broker_stats" in s:
        bs = s["broker_stats"]
        lines.append(f"  batches      {bs['batches']:,d} for {bs['requests']:,d} requests, mean "
                     f"{_f(bs['mean_batch_rows'])} rows; sizes "
                     + (" ".join(f"{k}:{v}" for k, v in bs["batch_sizes"].items()) or "-"))
    lines.append(f"  generator    {gen['procs']} proc(s) x {'+'.join(map(str, gen['threads']))} threads, "
                 f"{gen['cpu_cores']:.2f} cores ({gen['cpu_share_of_machine']:.0%} of the machine); machine CPU "
                 f"busy {_f(s['machine']['cpu_busy'], '{:.0%}')}")
    lines += [f"  {p['role']:<12} pid {p['pid']:<7} {str(p.get('device', '')):<7} peak RSS "
              f"{_f(p['peak_rss_mb'], '{:8.1f}')} MB  PSS {_f(p.get('pss_mb'), '{:8.1f}')} MB  CPU "
              f"{_f(p['cpu_cores'])} cores, {_f(p.get('cpu_us_per_request'), '{:.1f}')} us/request"
              for p in s["server_processes"]]
    if "cpu_us_per_request" in s:
        us = s["cpu_us_per_request"]
        lines.append(f"  per request  CPU us: broker {_f(us['broker'], '{:.1f}')}, workers {_f(us['workers'], '{:.1f}')}, "
                     f"generator {_f(us['generator'], '{:.1f}')}; server tree PSS "
                     f"{_f(s.get('server_pss_mb'), '{:.1f}')} MiB")
    return "\n".join(lines + [f"  WARNING: {w}" for w in s["warnings"]])


def level_table(runs: Iterable[dict[str, Any]]) -> list[list[str]]:
    out = [["offered", "req/s", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "errors", "gen CPU"]]
    for s in runs:
        out.append([f"c={s['level']:g}" if s["mode"] == "closed" else f"{s['level']:g}/s",
                    f"{s['throughput_rps']:,.1f}", *(_f(s["latency_ms"][k]) for k, _ in LATENCY_KEYS),
                    str(s["requests_failed"]), f"{s['generator']['cpu_cores']:.2f}c"])
    return out


def text_table(rows: list[list[str]], left: int = 1) -> str:
    """Columns before `left` are left-aligned, the others right-aligned; a rule under the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def markdown_table(rows: list[list[str]], left: int = 1) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i < left else "---:" for i in range(len(head))) + "|"]
    return "\n".join(lines + ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in body])


def compare_table(results: list[dict[str, Any]]) -> list[list[str]]:
    """Header + one line per (scenario, system); the first 3 columns are text."""
    out = [["scenario", "payload", "system", "req/s", "p50 ms", "p99 ms", "p99.9 ms", "errors", "batch",
            "gen CPU", "vs Flask", "vs native", "tgw/floor"]]
    for res in results:
        r, n = res["ratios"], res["payload_bytes"]
        for system in (s for s in SYSTEMS if s in res["rows"]):
            row = res["rows"][system]
            first = [res["scenario"], f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n} B", label(system, row)]
            if "error" in row:
                out.append(first + ["FAILED: " + str(row["error"]).splitlines()[0][:60]] + [""] * 9)
                continue
            lat, tgw, over_native = row["latency_ms"], system == "tgw", r.get(f"{system}_over_tgw_throughput")
            batch = _f((row.get("broker_stats") or {}).get("mean_batch_rows"), "{:.1f}") if system in TGW_SYSTEMS \
                else str(row.get("floor", {}).get("best_batch")) if system == "in-process" else ""
            out.append(first + [
                _f(row["throughput_rps"], "{:,.0f}") + (" sps" if system == "in-process" else ""),
                *(_f(lat.get(k), "{:.3f}") for k in ("p50", "p99", "p99_9")), str(row.get("requests_failed", 0)),
                batch, _f(row.get("generator", {}).get("cpu_cores")),
                _f(r.get(f"{system}_over_flask_throughput"), "{:.2f}x") if system in TGW_SYSTEMS else "",
                _f(over_native, "{:.2f}x") if system in TGW_SYSTEMS[1:] else "",
                _f(r["tgw_over_floor_throughput"]) if tgw else ""])
    return out


def cost_table(results: list[dict[str, Any]]) -> list[list[str]]:
    """Header + one line per (scenario, server system): CPU microseconds per request over the
    window (the broker process, the processes doing the work, the load generator), the whole
    server tree's PSS at the window's end, for tgw native its ratio to the transport floor and its
    p50 over the c=1 budget (transport p50 + in-process batch-1 p50), for every tgw row how busy its
    batches kept the workers, and for the HTTP rows of tgw their broker CPU per request over the
    native row's; the first 2 columns are text."""
    out = [["scenario", "system", "req/s", "broker us/req", "workers us/req", "gen us/req", "server PSS MiB",
            "tgw/transport", "p50 - (transport + floor) ms", "worker busy", "compute/floor", "broker vs native"]]
    for res in results:
        r = res["ratios"]
        for system in (s for s in SYSTEMS if s in res["rows"] and s != "in-process"):
            row = res["rows"][system]
            if "error" in row:
                continue
            us, tgw, served = row.get("cpu_us_per_request") or {}, system == "tgw", system in TGW_SYSTEMS
            out.append([res["scenario"], label(system, row), _f(row["throughput_rps"], "{:,.0f}"),
                        *(_f(us.get(k), "{:.1f}") for k in ("broker", "workers", "generator")),
                        _f(row.get("server_pss_mb"), "{:.0f}"),
                        _f(r.get("tgw_over_transport_throughput"), "{:.2f}x") if tgw else "",
                        _f(r.get("tgw_p50_excess_ms"), "{:+.3f}") if tgw else "",
                        _f((row.get("batching") or {}).get("worker_busy"), "{:.0%}") if served else "",
                        _f((row.get("batching") or {}).get("compute_over_floor"), "{:.2f}x") if served else "",
                        _f(r.get(f"{system}_broker_us_over_tgw"), "{:.2f}x") if served and not tgw else ""])
    return out


RESULTS_HEADER = """# tgw benchmark results

Written by `tgw-bench compare` (bench/README.md says what each row means). Each section is
replaced by the latest run of its mode. Compare ratios, not absolute numbers.
"""
SECTIONS = ("full", "quick", "custom")


def machine() -> dict[str, Any]:
    import zmq
    try:
        with open("/proc/cpuinfo") as f:
            cpu = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
    except OSError:
        cpu = None
    versions = {"libzmq": zmq.zmq_version()}
    for pkg in ("torch", "pyzmq", "flask", "gunicorn"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"cores": os.cpu_count(), "cpu_model": cpu.group(1).strip() if cpu else "unknown",
            "mem_gib": round(psutil.virtual_memory().total / 2**30, 1), "kernel": platform.release(),
            "python": platform.python_version(), "versions": versions}


def section_markdown(result: dict[str, Any], json_rel: str, png_rel: str) -> str:
    s, m = result["settings"], result["machine"]
    v = m["versions"]
    lines = [
        f"## {result['mode']} run - {result['date']}", "",
        f"Command: `{result['command']}`", "",
        f"Machine: {m['cores']} cores, {m['cpu_model']}, {m['mem_gib']} GiB RAM, Linux {m['kernel']}, Python "
        f"{m['python']}, torch {v['torch']}, pyzmq {v['pyzmq']} (libzmq {v['libzmq']}), gunicorn "
        f"{v['gunicorn']}, Flask {v['flask']}", "",
        f"Settings: {s['duration']:g} s measured per row after {s['warmup']:g} s warm-up; tgw broker with "
        f"{s['tgw_workers']} cpu worker(s) x 1 thread; gunicorn {s['flask_workers']} sync workers x 1 torch "
        f"thread; in-process floor: {s['floor_procs']} model copies x 1 torch thread; HTTP load generator: "
        f"{s['http_generator']}; wall time {result['wall_s']:.0f} s.", "",
        markdown_table(compare_table(result["scenarios"]), 3), "",
        "req/s of the in-process floor is samples/s (sps) summed over its copies at the best of batch 1, "
        "max/4 and max (that batch size is in the batch column); its p50/p99 are one batch-1 call. batch of "
        "the tgw rows = mean rows per batch the broker formed. tgw native is the tgw client through the load "
        "generator; tgw HTTP and tgw HTTP binary are the same broker's KServe v2 HTTP face, loaded by the HTTP "
        "generator that loads Flask+gunicorn: tgw HTTP posts the very body file Flask gets (v2 JSON, flat "
        "`data`), tgw HTTP binary the binary tensor extension (JSON header + raw bytes, binary outputs). "
        "vs Flask = the row's req/s over Flask's; vs native = the HTTP row's req/s over tgw native's (a "
        "different generator, on the same cores: compare their gen us/req); tgw/floor "
        "= tgw rows/s over the floor's samples/s. gen CPU = cores used by the load generator in the window.",
        "", "CPU per request and memory (in-process floor rows have none):", "",
        markdown_table(cost_table(result["scenarios"]), 2), "",
        "us/req = CPU microseconds (user + system) over the window divided by the requests measured in it: "
        "broker = the tgw broker process (transport floor: the echo broker); workers = its worker processes "
        "(transport floor: the echo worker; Flask: every gunicorn process); gen = the load generator's "
        "processes (wrk for wrk-loaded rows). server PSS = proportional set size summed over the server's "
        "processes and their descendants at the window's end (shared pages, shared-memory arenas included, "
        "split between their users). tgw/transport = tgw req/s over the transport floor's; p50 - (transport + "
        "floor) = tgw p50 minus the transport floor's p50 and the in-process batch-1 p50. worker busy = the "
        "workers' summed batch compute time over the window x workers; compute/floor = that compute time over "
        "the in-process floor's time for the same batch sizes. broker vs native = the HTTP row's broker "
        "us/req over tgw native's (what the HTTP face costs the broker per request).",
    ]
    if s["http_generator"].startswith("python"):
        lines += ["", "**wrk was not installed for this run**: the HTTP rows (Flask+gunicorn, tgw HTTP, tgw HTTP "
                      "binary) were loaded by the Python fallback generator (keep-alive HTTP/1.1 sockets through "
                      "loadgen.py), which spends more CPU per request than wrk and competes with the servers for "
                      "the same cores, so those rows (and vs Flask) are not comparable with wrk-loaded runs. "
                      "Install wrk and rerun for them."]
    lines += ["", f"Raw results: `{json_rel}`; plot: `{png_rel}` ."]
    warnings = [f"- {sc['scenario']} / {label(name, row)}: {w}" for sc in result["scenarios"]
                for name, row in sc["rows"].items() for w in row.get("warnings", [])]
    if warnings:
        lines += ["", "Warnings raised during this run:", "", *warnings]
    return "\n".join(lines) + "\n"


def update_results_md(path: str, section: str, body: str) -> None:
    """Replace this mode's section (between its markers) where it stands; a new one goes next to
    the others in SECTIONS order (full first). Text outside the markers is kept as it is."""
    text = open(path).read() if os.path.exists(path) else RESULTS_HEADER
    block = f"<!-- {section}:start -->\n{body}<!-- {section}:end -->"
    pattern = re.compile(re.escape(f"<!-- {section}:start -->") + r".*?" + re.escape(f"<!-- {section}:end -->"), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        i = SECTIONS.index(section)
        later = [s for s in SECTIONS[i + 1:] if f"<!-- {s}:start -->" in text]
        earlier = [s for s in SECTIONS[:i] if f"<!-- {s}:end -->" in text]
        if later:
            at = text.index(f"<!-- {later[0]}:start -->")
            text = text[:at] + block + "\n\n" + text[at:]
        elif earlier:
            at = text.index(f"<!-- {earlier[-1]}:end -->") + len(f"<!-- {earlier[-1]}:end -->")
            text = text[:at] + "\n\n" + block + text[at:]
        else:
            text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def write_outputs(result: dict[str, Any], dest: str, results_md: bool = True, plot=None) -> None:
    """The comparison's files: results/<date>[-mode].json and, drawn by `plot(result, path)`
    (plots.plot_compare), .png under dest, and its RESULTS.md section."""
    stem = os.path.join(dest, "results", result["date"] + ("" if result["mode"] == "full" else "-" + result["mode"]))
    write_json(stem + ".json", result)
    try:
        if plot is not None:
            plot(result, stem + ".png")
    except Exception as exc:  # noqa: BLE001 - matplotlib is optional
        print(f"no plot: {type(exc).__name__}: {exc}", file=sys.stderr)
    if results_md:
        update_results_md(os.path.join(dest, "RESULTS.md"), result["mode"], section_markdown(
            result, os.path.relpath(stem + ".json", dest), os.path.relpath(stem + ".png", dest)))
        print(f"\nupdated {os.path.join(dest, 'RESULTS.md')} ({result['mode']} section)")
    print(f"wrote {stem}.json and .png; {result['wall_s']:.0f} s")


def result_path(out: Optional[str], stem: str, date: str, mode: str) -> str:
    """Where a scenario's result file goes: `out`/results/ (default bench/ of the checkout when run
    from its root, else the installed package's bench/, else .), named stem-date[-mode].json."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dest = out or ("bench" if os.path.isfile("bench/cli.py") else
                   here if os.path.isfile(os.path.join(here, "RESULTS.md")) else ".")
    return os.path.join(dest, "results", f"{stem}-{date}" + ("" if mode == "full" else f"-{mode}") + ".json")


def conclude(res: dict, stem: str, out: Optional[str], date: str, mode: str, t0: float, table: str) -> str:
    """A scenario's end: its wall time recorded, its tables printed, its result file written (the path)."""
    res["wall_s"] = time.monotonic() - t0
    print("\n" + table)
    path = result_path(out, stem, date, mode)
    write_json(path, res)
    print(f"wrote {path}; {res['wall_s']:.0f} s")
    return path


def write_json(path: str, data: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=lambda o: o.tolist() if isinstance(o, (np.ndarray, np.generic)) else str(o))
        f.write("\n")


# ---- `tgw-bench formats`: each format beside its own floor -------------------------------------

FORMAT_LEVELS = (1, 64)   # c=1: batch-1 calls; c=64: rows/s at max_batch_size


def formats_rows(models: dict[str, dict], tgw: dict[str, dict], floor: dict[str, dict],
               refused: dict[str, str]) -> list[dict[str, Any]]:
    """`tgw-bench formats`' rows: per (model, format, concurrency) tgw's figures beside the floor of that
    very program, or why there are none (`refused`: left out of the broker)."""
    rows = []
    for name, d in models.items():
        for c in FORMAT_LEVELS:
            t, f = tgw.get(name, {}).get(c, {"error": "not run"}), floor.get(name, {"error": "not run"})
            fl = f.get(c) if "error" not in f else None
            row = {"model": d["base"], "format": d["format"], "concurrency": c,
                   "error": f"not served: {refused[name]}" if name in refused else t.get("error") or f.get("error")}
            if "error" not in t:
                lat, bs = t["latency_ms"], t.get("broker_stats") or {}
                row.update(requests=t["requests_ok"], rps=t["throughput_rps"], p50_ms=lat["p50"], p99_ms=lat["p99"],
                           errors=t["errors"], mean_batch=bs.get("mean_batch_rows"),
                           worker_us=(t.get("cpu_us_per_request") or {}).get("workers"))
            if fl:
                row.update(floor_batch=fl["batch"], floor_rows_per_s=fl["rows_per_s"], floor_p50_ms=fl["p50_ms"])
            if row.get("rps") is not None and fl:
                row["tgw_over_floor"] = row["rps"] / fl["rows_per_s"]
            rows.append(row)
    return rows


def formats_table(rows: list[dict[str, Any]]) -> str:
    """Markdown, as it goes in RESULTS.md."""
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)
    lines = ["| model | format | c | tgw req/s | p50 ms | p99 ms | mean batch | worker CPU µs/req | floor (batch) rows/s "
             "| floor p50 ms | tgw / floor | errors |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        errs = r.get("error") or ", ".join(f"{k} x {v}" for k, v in (r.get("errors") or {}).items()) or "0"
        floor = f"{num(r.get('floor_rows_per_s'), ',.0f')} ({r.get('floor_batch', '-')})"
        lines.append(f"| {r['model']} | {r['format']} | {r['concurrency']} | {num(r.get('rps'), ',.0f')} "
                     f"| {num(r.get('p50_ms'), '.3f')} | {num(r.get('p99_ms'), '.3f')} | {num(r.get('mean_batch'), '.1f')} "
                     f"| {num(r.get('worker_us'), ',.0f')} "
                     f"| {floor} | {num(r.get('floor_p50_ms'), '.3f')} | {num(r.get('tgw_over_floor'), '.2f')} | {errs} |")
    return "\n".join(lines)
