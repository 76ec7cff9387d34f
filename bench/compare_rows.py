"""The comparison's scenarios, rows and ratios - pure functions, no processes (unit-testable).

A scenario is (model, concurrency). Each scenario has one row per system:

* `in-process`  - the floor: TorchScript called directly, one copy per core (tgw's worker
                  layout). req/s column = samples/s summed over the copies at the best of
                  batch 1, max/4 and max (the box's compute limit); latency = one batch-1 call.
* `transport`   - raw pyzmq client -> ROUTER -> DEALER worker echo, same payload and reply
                  sizes, driven by the same load generator as tgw.
* `tgw`         - tgw native client against a tgw broker.
* `flask`       - Flask + torch.jit.load under gunicorn sync workers, JSON bodies, wrk load.

Ratios: tgw/Flask (throughput; and p50 latency, where < 1 means tgw is faster), tgw/floor
(tgw rows/s over the in-process floor's samples/s: the share of the box's compute limit that
reaches callers), tgw/transport (throughput against the bare ZeroMQ round trip).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

SYSTEMS = ("in-process", "transport", "tgw", "flask")
LABELS = {"in-process": "in-process floor", "transport": "transport floor (pyzmq echo)",
          "tgw": "tgw native", "flask": "Flask+gunicorn (wrk)"}


@dataclass(frozen=True)
class Scenario:
    model: str
    concurrency: int

    @property
    def key(self) -> str:
        return f"{self.model} c={self.concurrency}"


SCENARIOS = (Scenario("mlp", 1), Scenario("mlp", 16), Scenario("mlp", 64),
             Scenario("resnet", 1), Scenario("resnet", 16), Scenario("resnet", 64),
             Scenario("resnet224", 16))


def floor_row(floor: dict[str, Any]) -> dict[str, Any]:
    """A table row from floor.py's JSON (runs at batch 1 and at max batch)."""
    b1 = min(floor["runs"], key=lambda r: r["batch"])
    bmax = max(floor["runs"], key=lambda r: r["batch"])
    best = max(floor["runs"], key=lambda r: r["samples_per_s"])  # large batches are not always faster
    return {"throughput_rps": best["samples_per_s"], "rows_per_s": best["samples_per_s"],
            "latency_ms": {"p50": b1["latency_ms"]["p50"], "p90": None, "p99": b1["latency_ms"]["p99"],
                           "p99_9": None}, "requests_failed": 0, "errors": {},
            "floor": {"batch1_samples_per_s": b1["samples_per_s"], "max_batch": bmax["batch"],
                      "max_batch_samples_per_s": bmax["samples_per_s"], "best_batch": best["batch"],
                      "procs": floor.get("procs"), "threads": floor.get("threads"),
                      "module": floor.get("module"), "rounds": floor.get("rounds", 1)},
            "machine": {"other_cpu_cores": floor.get("background_cpu_cores")},
            "warnings": ([f"other processes used {floor['background_cpu_cores']:.2f} cores while the floor "
                          f"was measured"] if (floor.get("background_cpu_cores") or 0) >= 0.25 else [])}


def _div(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def _get(row: Optional[dict], *path: str) -> Optional[float]:
    cur: Any = row
    for p in path:
        if not isinstance(cur, dict) or p not in cur:
            return None
        cur = cur[p]
    return cur


def ratios(rows: dict[str, dict]) -> dict[str, Optional[float]]:
    tgw, flask = rows.get("tgw"), rows.get("flask")
    floor, transport = rows.get("in-process"), rows.get("transport")
    ok = lambda r: r is not None and "error" not in r  # noqa: E731
    return {
        "tgw_over_flask_throughput": _div(_get(tgw, "throughput_rps"), _get(flask, "throughput_rps"))
        if ok(tgw) and ok(flask) else None,
        "tgw_over_flask_p50": _div(_get(tgw, "latency_ms", "p50"), _get(flask, "latency_ms", "p50"))
        if ok(tgw) and ok(flask) else None,
        "tgw_over_floor_throughput": _div(_get(tgw, "rows_per_s"), _get(floor, "rows_per_s"))
        if ok(tgw) and ok(floor) else None,
        "tgw_over_transport_throughput": _div(_get(tgw, "throughput_rps"), _get(transport, "throughput_rps"))
        if ok(tgw) and ok(transport) else None,
    }


def scenario_result(sc: Scenario, payload_bytes: int, rows: dict[str, dict]) -> dict[str, Any]:
    return {"scenario": sc.key, "model": sc.model, "concurrency": sc.concurrency,
            "payload_bytes": payload_bytes, "rows": rows, "ratios": ratios(rows)}


def _n(v: Optional[float], fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def _size(n: int) -> str:
    return f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n} B"


def table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """Header + one line per (scenario, system) for text and markdown tables."""
    out = [["scenario", "payload", "system", "req/s", "p50 ms", "p99 ms", "p99.9 ms", "errors", "batch",
            "gen CPU", "tgw/Flask", "tgw/floor"]]
    for res in results:
        r = res["ratios"]
        for system in SYSTEMS:
            row = res["rows"].get(system)
            if row is None:
                continue
            first = [res["scenario"], _size(res["payload_bytes"]), LABELS[system]]
            if "error" in row:
                out.append(first + ["FAILED: " + str(row["error"]).splitlines()[0][:60]] + [""] * 8)
                continue
            lat = row["latency_ms"]
            gen = row.get("generator", {}).get("cpu_cores")
            errs = row.get("requests_failed", 0)
            is_tgw = system == "tgw"
            if is_tgw:
                batch = _n((row.get("broker_stats") or {}).get("mean_batch_rows"), "{:.1f}")
            elif system == "in-process":
                batch = str(row["floor"]["best_batch"])
            else:
                batch = ""
            out.append(first + [
                _n(row["throughput_rps"], "{:,.0f}") + (" sps" if system == "in-process" else ""),
                _n(lat.get("p50"), "{:.3f}"), _n(lat.get("p99"), "{:.3f}"), _n(lat.get("p99_9"), "{:.3f}"),
                str(errs), batch, _n(gen, "{:.2f}"),
                _n(r["tgw_over_flask_throughput"], "{:.2f}x") if is_tgw else "",
                _n(r["tgw_over_floor_throughput"], "{:.2f}") if is_tgw else "",
            ])
    return out


def format_text(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def format_markdown(rows: list[list[str]]) -> str:
    head, *body = rows
    align = "|".join("---:" if i >= 3 else "---" for i in range(len(head)))
    lines = ["| " + " | ".join(head) + " |", f"|{align}|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in body]
    return "\n".join(lines)
