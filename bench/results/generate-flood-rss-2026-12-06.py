# A 40 s flood (40,000 sequences of 8 outputs at 1,000/s against one worker's 64 slots, queue 256)
# through tgw-bench generate's flood_row, with the worker's and the broker's RSS read every 5 s:
# whether the worker's RSS settles or keeps growing with the sequences served.
# Run: .venv/bin/python bench/results/generate-flood-rss-2026-12-06.py
import json, os, shutil, tempfile, threading, time
import psutil
from tgw.bench.harness import gen_faults, gen_model
from tgw.bench.scenarios.generate import GEN, tgw_config
from tgw.testing.child import BrokerProc

d = tempfile.mkdtemp(prefix="tgwflood-", dir="/tmp")
w = gen_model.save_weights(gen_model.DIMS, 1, os.path.join(d, "w.pt"))
module = gen_model.load(w)
cfg = tgw_config(w, module, 1, ["generate"])
cfg["models"][0]["max_queue"] = 256
plist = gen_model.prompts(256, 1, module.cfg.vocab)
b = BrokerProc(cfg, d).start()
samples, stop = [], threading.Event()
try:
    worker = psutil.Process(b.pid).children()[0]
    t0 = time.monotonic()

    def sample():
        while not stop.is_set():
            samples.append((round(time.monotonic() - t0), psutil.Process(b.pid).memory_info().rss >> 20,
                            worker.memory_info().rss >> 20))
            stop.wait(5)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    r = gen_faults.flood_row(b.address, GEN, lambda: {"broker": b.pid, "worker": worker.pid}, plist, 40_000, 1000.0,
                             8, lambda m: None)
    stop.set()
    th.join()
    samples.append((round(time.monotonic() - t0), psutil.Process(b.pid).memory_info().rss >> 20,
                    worker.memory_info().rss >> 20))
finally:
    b.stop()
    shutil.rmtree(d, ignore_errors=True)
print(json.dumps({k: r[k] for k in ("sequences", "outcomes", "peak_active", "slots")}), f"wall {r['wall_s']:.1f} s")
print("s  broker_MiB  worker_MiB")
for t, br, wk in samples:
    print(f"{t:3d} {br:6d} {wk:6d}")
