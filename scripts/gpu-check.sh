#!/usr/bin/env bash
# GPU checks on a machine with CUDA and no network: the GPU tests, then the GPU bench
# (`tgw-bench gpu`, bench/scenarios/gpu.py), one summary at the end. It uses the machine's own
# Python and CUDA torch (never scripts/setup-venv.sh, which installs the CPU torch): the packages
# that Python lacks come from .whl/, which `bash scripts/gpu-wheels.sh` fills on a machine with
# network, and tgw is imported from this checkout through a folder of links, not installed.
#
#   bash scripts/gpu-check.sh
#   bash scripts/gpu-check.sh --summary   # the summary of the run in $OUT again, running nothing
#
# Environment: PYTHON (default python3), OUT (logs, tests.xml, gpu_bench.json, summary.txt;
# default /tmp/tgw-gpu-check), TGW_SITE (where wheels and the tgw links go; default
# /tmp/tgw-site), TGW_BENCH_ARGS (default --quick; e.g. "--quick --device cpu" on a machine with
# no GPU), TGW_TESTS_TIMEOUT and TGW_BENCH_TIMEOUT (seconds; defaults 210 and 240, so a run ends
# within 8 minutes), TGW_FACES_ARGS (the fronts sweep's arguments, below; TGW_FACES=0 skips it) and
# TGW_FACES_TIMEOUT (default 180 s). Without a GPU it still runs (the tests skip, the bench says "no
# CUDA device"), and ends FAILED: "no GPU test passed". Exit status 0 only when the tests, the bench
# and the fronts sweep (where it ran) exited 0 and at least one GPU test passed; targets missed are
# reported only. The fronts sweep (issue 43) is `tgw-bench faces` over 0, 1, 2, 4 and 8 front
# processes on this box's cores; its JSON is folded into gpu_bench.json ("faces") and its log
# into bench.log, so $OUT keeps its eight files.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/tgw-gpu-check}
SITE=${TGW_SITE:-/tmp/tgw-site}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)') || { echo "gpu-check: no ${PYTHON:-python3}" >&2; exit 2; }

# 6. one summary, and the verdict: OK only when the tests and the bench exited 0 and a GPU test
#    passed. Run last, or alone with --summary on the files a run left in $OUT (exits.txt: its
#    steps' exit statuses and the test files).
summary() {
    local tests bench files
    local faces
    faces=$(sed -n 's/^faces=//p' "$OUT/exits.txt" 2>/dev/null); faces=${faces:--1}   # -1: the sweep did not run
    tests=$(sed -n 's/^tests=//p' "$OUT/exits.txt" 2>/dev/null); tests=${tests:-2}
    bench=$(sed -n 's/^bench=//p' "$OUT/exits.txt" 2>/dev/null); bench=${bench:-2}
    files=$(sed -n 's/^files=//p' "$OUT/exits.txt" 2>/dev/null)
    "$PY" - "$OUT" "$tests" "$bench" "$files" "$faces" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import collections, json, os, sys
import xml.etree.ElementTree as ET
out, tests, bench, files, faces = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
why = {124: "timed out", 137: "killed after its time ran out", 5: "no test collected"}
print("\n==== gpu-check summary ====")
try:
    with open(os.path.join(out, "env.log")) as f:
        print("\n".join(line for line in f.read().splitlines() if line.startswith(("torch", "cuda:", "python"))))
except OSError:
    print("no env.log")
passed, skips = None, collections.Counter()
try:
    s = ET.parse(os.path.join(out, "tests.xml")).getroot()
    s = s if s.tag == "testsuite" else s.find("testsuite")
    n = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    skips.update(x.get("message", "?") for x in s.iter("skipped"))
    counts = f"{passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped"
except (OSError, ET.ParseError, AttributeError):
    counts = "no junit report"
print(f"tests: {counts} (pytest exit {tests}{', ' + why[tests] if tests in why else ''}; {files})")
try:
    with open(os.path.join(out, "gpu_bench.json")) as f:
        r = json.load(f)
except (OSError, ValueError):
    r = None
sweep = r.pop("faces", None) if isinstance(r, dict) else None
r = r or None   # only the sweep's JSON there: the bench wrote none
if r is None:
    print(f"bench: no JSON written (exit {bench}{', ' + why[bench] if bench in why else ''})")
elif "skipped" in r:
    print(f"bench: skipped, {r['skipped']} (exit {bench})")
else:
    print(f"bench: exit {bench}, {r['wall_s']:.0f} s")
    for line in r.get("summary", []) + [f"FAILED {x}" for x in r.get("failed", [])]:
        print(f"  {line}")
if faces >= 0 or sweep:
    print(f"fronts sweep (tgw-bench faces): exit {faces}{', ' + why[faces] if faces in why else ''}"
          + ("" if sweep else ", no JSON written"))
if sweep:   # per face and front count: req/s, its ratio to 0 fronts, the loop's, fronts' and tree's CPU per request
    blocks = sweep.get("fronts", {})
    def us(row, key):
        v = ((row.get("cpu") or {}).get("us_per_request") or {}).get(key)
        return "-" if v is None else f"{v:.1f}"
    table = [["face", "fronts (live)", "req/s", "x 0 fronts", "loop us/req", "fronts us/req", "tree us/req", "rows/batch"]]
    for face in dict.fromkeys(f for b in blocks.values() for f in b.get("rows", {})):
        base = (blocks.get("0", {}).get("rows", {}).get(face) or {}).get("throughput_rps")
        for n, b in blocks.items():
            row = b.get("rows", {}).get(face) or {"error": "not run"}
            live = f"{n} ({b.get('fronts_live', '?')})"
            if "error" in row:
                table.append([face, live, "failed"] + ["-"] * 5)
                continue
            rps, batch = row["throughput_rps"], (row.get("broker_stats") or {}).get("mean_batch_rows")
            table.append([face, live, f"{rps:,.0f}", f"{rps / base:.2f}" if base else "-", us(row, "loop"),
                          us(row, "fronts"), us(row, "tree"), "-" if batch is None else f"{batch:.1f}"])
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for i, row in enumerate(table):
        print("  " + "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  " + "-" * (sum(widths) + 2 * len(widths) - 2))
    if sweep.get("interrupted"):
        print("  (the sweep ran out of time: the front counts missing were not measured)")
print(f"logs and JSON: {out}")
failed = [f"tests exit {tests}"] if tests else []
if passed is None:
    failed.append("no junit report")
elif passed == 0:   # every GPU test skipped (no CUDA here), or none ran: nothing was checked on a GPU
    reasons = "; ".join(f"{k} x{v}" if v > 1 else k for k, v in skips.most_common(3)) or "none ran"
    print(f"gpu-check: no GPU test passed ({reasons})")
    failed.append("no GPU test passed")
if bench:
    failed.append(f"bench exit {bench}")
if faces > 0:
    failed.append(f"fronts sweep exit {faces}")
print("gpu-check: " + ("OK" if not failed else f"FAILED ({', '.join(failed)})"))
sys.exit(1 if failed else 0)
EOF
    return "${PIPESTATUS[0]}"
}
if [ "${1:-}" = "--summary" ]; then
    summary
    exit
fi
rm -f "$OUT"/{env.log,install.log,tests.log,tests.xml,bench.log,gpu_bench.json,summary.txt,exits.txt,faces.json}
say() { echo "gpu-check: $*" | tee -a "$OUT/install.log"; }

# 1. the packages this Python lacks, from .whl (the machine has no network)
NEEDED="zmq msgspec lz4.frame orjson setproctitle pydantic annotated_types typing_inspection flask gunicorn"
imports_ok() { "$PY" -c "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]" $NEEDED 2>/dev/null; }
if imports_ok; then
    say "every package tgw needs imports already: no wheels installed"
else
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        say "packages are missing ($NEEDED) and .whl/ holds no wheels: run 'bash scripts/gpu-wheels.sh' on a machine with network first, then bring .whl/ along with the checkout"
        exit 2
    fi
    say "installing $(ls .whl/*.whl | wc -l) wheels from .whl into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        >>"$OUT/install.log" 2>&1 || { say "pip install from .whl failed (see $OUT/install.log)"; exit 2; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    # --no-deps: say which requirement of those wheels this machine's packages do not meet
    "$PY" - "$SITE" <<'EOF' 2>&1 | tee -a "$OUT/install.log"
import glob, os, sys
from importlib import metadata
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
for dist in glob.glob(os.path.join(sys.argv[1], "*.dist-info")):
    d = metadata.Distribution.at(dist)
    for text in d.requires or []:
        r = Requirement(text)
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        try:
            have = metadata.version(r.name)
        except metadata.PackageNotFoundError:
            have = None
        if have is None or (r.specifier and not r.specifier.contains(have, prereleases=True)):
            print(f"gpu-check: WARNING {d.metadata['Name']} needs {r}, this machine has {have or 'none'}")
EOF
    imports_ok || { say "still missing after the install: $("$PY" -c "import ${NEEDED// /, }" 2>&1 | tail -1)"; exit 2; }
fi

# 2. tgw from this checkout: pyproject.toml maps tgw.X to the folder X
tgw_here() {
    "$PY" - "$ROOT" <<'EOF' 2>/dev/null
import os, sys
import tgw.broker, tgw.workers, tgw.shm, tgw.client, tgw.bench, tgw.testing
root = os.path.realpath(sys.argv[1])
sys.exit(0 if all(os.path.realpath(m.__file__).startswith(root + os.sep)
                  for m in (tgw.broker, tgw.workers, tgw.shm, tgw.client, tgw.bench, tgw.testing)) else 1)
EOF
}
if tgw_here && [ "$("$PY" -c 'import tgw; print(list(tgw.__path__)[0])')" != "$SITE/tgw" ]; then
    say "tgw imports from this checkout already"
else   # (again, on a second run: the links and the script are remade, which changes nothing)
    mkdir -p "$SITE/tgw" "$SITE/tgw-bin"   # not $SITE/bin: pip --target --upgrade replaces that one
    : >"$SITE/tgw/__init__.py"
    for link in broker=broker workers=workers shm=shm client=client bench=bench testing=bench/testing; do
        ln -sfn "$ROOT/${link#*=}" "$SITE/tgw/${link%%=*}"   # [tool.setuptools] package-dir: tgw.NAME = DIR
    done
    printf '#!/bin/sh\nexec "%s" -m tgw.broker "$@"\n' "$PY" >"$SITE/tgw-bin/tgw-broker"   # the console script
    chmod +x "$SITE/tgw-bin/tgw-broker"
    case ":${PYTHONPATH:-}:" in *":$SITE:"*) ;; *) export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" ;; esac
    export PATH="$SITE/tgw-bin:$PATH"
    tgw_here || { say "tgw does not import from $SITE/tgw -> $ROOT: $("$PY" -c 'import tgw.broker, tgw.bench' 2>&1 | tail -1)"; exit 2; }
    say "tgw imports from $SITE/tgw (links to $ROOT); PYTHONPATH=$PYTHONPATH"
fi

# 3. what runs here
"$PY" - <<'EOF' 2>&1 | tee "$OUT/env.log"
import platform, sys
import torch
print(f"python {platform.python_version()} ({sys.executable})")
print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}; cuda available {torch.cuda.is_available()}, "
      f"{torch.cuda.device_count()} device(s)")
for i in range(torch.cuda.device_count()):
    print(f"cuda:{i} {torch.cuda.get_device_name(i)}")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || { say "$PY cannot import torch: this script uses the machine's own (CUDA) torch"; exit 2; }
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$OUT/env.log"
else
    echo "nvidia-smi: not on PATH" | tee -a "$OUT/env.log"
fi

# 4. the GPU tests: the files that mark tests gpu (collecting all of tests/ would import modules
#    whose packages the GPU run does not carry, e.g. tritonclient for tests/process/test_http.py)
mapfile -t files < <(grep -lE "pytest\.mark\.gpu\b" tests/*.py tests/*/*.py 2>/dev/null | sort)
[ ${#files[@]} -gt 0 ] || files=(tests/)
echo "gpu-check: pytest -m gpu ${files[*]}"
timeout -s INT -k 30 "${TGW_TESTS_TIMEOUT:-210}" "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs \
    --junitxml="$OUT/tests.xml" "${files[@]}" 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}
printf 'tests=%s\nfiles=%s\n' "$tests" "${files[*]}" >"$OUT/exits.txt"

# 5. the GPU bench
echo "gpu-check: tgw-bench gpu ${TGW_BENCH_ARGS:---quick}"
# shellcheck disable=SC2086 # TGW_BENCH_ARGS is a list of arguments
timeout -k 30 "${TGW_BENCH_TIMEOUT:-240}" "$PY" -m tgw.bench.cli gpu ${TGW_BENCH_ARGS:---quick} \
    --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}
echo "bench=$bench" >>"$OUT/exits.txt"

# 5b. the fronts sweep (issue 43): mlp's req/s over each face with 0, 1, 2, 4 and 8 front
#     processes on this box's cores, the scheduler loop's and the fronts' CPU per request; about
#     2.5 minutes, cut at TGW_FACES_TIMEOUT (what was measured by then is still written)
FACES_ARGS=${TGW_FACES_ARGS:---fronts 0,1,2,4,8 --faces native,http,grpc,grpc-stream --no-c1 --rounds 1 --duration 2 --warmup 1 --procs 4}
if [ "${TGW_FACES:-1}" != 0 ]; then
    echo "gpu-check: tgw-bench faces $FACES_ARGS" | tee -a "$OUT/bench.log"
    rm -f "$OUT/faces.json"
    # shellcheck disable=SC2086 # FACES_ARGS is a list of arguments
    timeout -k 30 "${TGW_FACES_TIMEOUT:-180}" "$PY" -m tgw.bench.cli faces $FACES_ARGS --json "$OUT/faces.json" \
        2>&1 | tee -a "$OUT/bench.log"
    echo "faces=${PIPESTATUS[0]}" >>"$OUT/exits.txt"
    "$PY" - "$OUT" <<'EOF'
import json, os, sys
src, dst = (os.path.join(sys.argv[1], name) for name in ("faces.json", "gpu_bench.json"))
try:
    with open(src) as f:
        sweep = json.load(f)
except (OSError, ValueError):
    sys.exit(0)   # none written: the summary says so
try:
    with open(dst) as f:
        r = json.load(f)
except (OSError, ValueError):
    r = {}
r["faces"] = sweep
with open(dst, "w") as f:
    json.dump(r, f, indent=1)
os.remove(src)
EOF
fi

summary   # step 6, defined above
