# What the broker's collector finds under load: the types of the objects in reference cycles
# (garbage only the collector frees) per request, through the native socket, the gRPC face and
# the HTTP face (binary extension). A broker (the demo mlp, one CPU worker) runs with gc.DEBUG_SAVEALL armed once it has
# frozen its start-up heap, so every collection's garbage is kept in gc.garbage; 16 callers for
# 5 s on one face; at its exit it prints the kinds found. Run from the checkout's root:
#   .venv/bin/python bench/results/gc-grpc-cycles-2026-12-06.py
import os, signal, subprocess, sys, tempfile, time, json, socket

from tgw.bench.harness.loadgen import LoadSpec, run_load
from tgw.bench.harness.targets import GrpcTarget, find_model, v2_body, v2_target
from tgw.testing.demo import demo_models, tgw_config
from tgw.client import Client

CHILD = r'''
import atexit, collections, gc, sys
from tgw.shm import gc_watch
from tgw.broker.config.load import load_config
from tgw.broker.core.run import run_broker
armed = []
def arm(phase, info):
    if phase == "stop" and gc_watch.watch.frozen and not armed:
        armed.append(1)
        gc.set_debug(gc.DEBUG_SAVEALL)
gc.callbacks.append(arm)
def dump():
    kinds = collections.Counter(type(o).__module__ + "." + type(o).__qualname__ for o in gc.garbage)
    print("GARBAGE", sum(kinds.values()), dict(kinds.most_common(25)), flush=True)
atexit.register(dump)
sys.exit(run_broker(load_config(sys.argv[1]), sys.argv[2]))
'''


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close(); return port


def one(face, work, models):
    import yaml
    cfg = tgw_config(models, ["mlp"], 1)
    cfg["grpc"]["port"] = port = free_port()
    cfg["http"]["port"] = http_port = free_port()
    cfg["model_roots"] = ["/"]
    path = os.path.join(work, f"{face}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    address = f"ipc://{work}/{face}.sock"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, path, address], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for _ in range(600):
            try:
                with Client(address, connect_timeout=1) as c:
                    if c.health()["ready"]:
                        meta = find_model(c.models(), "mlp")
                        break
            except Exception:
                pass
            time.sleep(0.1)
        if face == "grpc":
            target = GrpcTarget(f"127.0.0.1:{port}", "mlp", meta)
        elif face == "http":
            body, header = v2_body(meta, binary=True)
            with open(os.path.join(work, "body.bin"), "wb") as f:
                f.write(body)
            target = v2_target(f"http://127.0.0.1:{http_port}", "mlp", os.path.join(work, "body.bin"), header, True)
        else:
            from tgw.bench.scenarios.gc_pauses import NativeAsyncTarget
            target = NativeAsyncTarget(address, "mlp", meta)
        raw = run_load(target, LoadSpec("closed", 16, 5.0, 0.5, 1))
        with Client(address) as c:
            requests = c.stats()["models"]["mlp"]["requests"]
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    line = next(l for l in out.splitlines() if l.startswith("GARBAGE"))
    _, total, kinds = line.split(" ", 2)
    print(f"{face}: {requests} requests answered in all; {total} objects in cycles after the freeze, "
          f"{int(total) / requests:.1f} per request; errors {raw['errors']}")
    print(f"  kinds: {kinds}")


if __name__ == "__main__":   # the load generator's processes are spawned: they import this file
    work = tempfile.mkdtemp(prefix="tgwcy-", dir="/tmp")
    models = demo_models(os.path.join(work, "models"))
    for face in ("native", "grpc", "http"):
        one(face, work, models)
