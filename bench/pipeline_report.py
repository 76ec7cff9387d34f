"""`tgw-bench pipeline`'s output: the summary table, the result file under bench/results/ and its
section of bench/RESULTS.md (between `<!-- pipeline:start -->` and `<!-- pipeline:end -->`,
replaced by each run; appended the first time)."""
from __future__ import annotations

import json
import os
import re
import time
from typing import Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
START, END = "<!-- pipeline:start -->", "<!-- pipeline:end -->"


def _f(x: Optional[float], fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def summary_lines(r: dict) -> list[str]:
    g, floor = r["goals"], r["classify"]["floor"]
    lines = ["| classify | req/s | p50 ms | p99 ms | broker us/req | other load, cores | pipeline over it |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for c, rows in r["classify"]["levels"].items():
        ratio = rows["ratios"]
        lines.append(f"| (a) in-process, batched (floor) c={c} | {floor['throughput_rps']:.0f} | - | - | - | "
                     f"{_f(floor.get('other_cpu_cores'), '.2f')} | {ratio['pipeline_over_floor']:.2f}x |")
        for key, name, over in (("flask", "(b) Flask + gunicorn", "pipeline_over_flask"),
                                ("caller_decodes", "(c) tgw, caller decodes -> resnet", "pipeline_over_caller_decodes"),
                                ("pipeline", "tgw classify pipeline", None)):
            row = rows[key]
            lines.append(f"| {name} c={c} | {row['throughput_rps']:.0f} | {_f(row['p50_ms'], '.2f')} | "
                         f"{_f(row['p99_ms'], '.2f')} | {_f(row['broker_us_per_request'])} | "
                         f"{_f(row['other_cpu_cores'], '.2f')} | {_f(ratio[over], '.2f') + 'x' if over else '-'} |")
    lines.append("")
    for c, rows in r["classify"]["levels"].items():
        ratio = rows["ratios"]
        lines.append(f"c={c}: pipeline / Flask {ratio['pipeline_over_flask']:.2f}x (goal >= {g['pipeline_over_flask']}), "
                     f"pipeline / caller-decodes {ratio['pipeline_over_caller_decodes']:.2f}x (goal >= "
                     f"{g['pipeline_over_caller_decodes']}), broker CPU per added step hop "
                     f"{_f(ratio['broker_us_per_added_hop'])} us (goal <= {g['broker_us_per_hop']:g})")
    s = r["stage_concurrency"]
    lines.append(f"stage concurrency (5 ms stage -> 5 ms model, 1 stage worker + 1 model worker, c=16, batch 1): "
                 f"{s['throughput_rps']:.0f} req/s = {s['over_serial']:.2f}x the {s['serial_sum_rps']:.0f} req/s of the "
                 f"serial sum of the compute per batch measured (goal >= {g['concurrency_over_serial']}): "
                 + ", ".join(f"{m} {_f(v, '.2f')} ms" for m, v in s["compute_ms_per_batch"].items()))
    lines.append(f"machine: {r['cores']} cores, load average {r['load_avg_1m_before']:.2f} before, "
                 f"{r['load_avg_1m_after']:.2f} after; phases {r['mode']['duration']:g} s after "
                 f"{r['mode']['warmup']:g} s warm-up")
    return lines


def write_results(r: dict, path: Optional[str], results_md: bool) -> str:
    path = path or os.path.join(BENCH_DIR, "results", f"pipeline-{time.strftime('%Y-%m-%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(r, f, indent=1, default=str)
    if results_md:
        body = (f"{START}\n## Pipelines - {r['date']} (issue 24)\n\nCommand: `{r['command']}`; raw numbers "
                f"`bench/results/{os.path.basename(path)}`. One 240x180 JPEG per request, closed loop; tgw: 1 cpu "
                f"model worker + 1 stage worker, 1 thread each; Flask: gunicorn sync workers = cores; the floor: "
                f"one process per core. Broker CPU per added step hop: (pipeline - caller-decodes broker CPU per "
                f"request) / 2, the pipeline having two steps more.\n\n" + "\n".join(summary_lines(r)) + f"\n{END}")
        md = os.path.join(BENCH_DIR, "RESULTS.md")
        text = open(md, encoding="utf-8").read()
        pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
        text = pattern.sub(lambda _: body, text) if START in text else text.rstrip("\n") + "\n\n" + body + "\n"
        with open(md, "w", encoding="utf-8") as f:
            f.write(text)
    return path
