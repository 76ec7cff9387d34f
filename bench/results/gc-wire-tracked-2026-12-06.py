# What `gc=False` on the wire Structs (shm/wire_base.py) saves: GC-tracked objects made per hot-path
# message, decoded as the broker and the worker decode them, with the committed declarations and
# with the same declarations tracked (wire_base's source with gc=True, in a child process); and
# whether the broker's per-request record (broker/state/pending.py Pending) is tracked.
# gc.get_count()[0] rises by one per tracked allocation and falls by one per tracked free: N
# messages decoded and held, with the collector off, show the tracked objects each leaves.
# Run: .venv/bin/python bench/results/gc-wire-tracked-2026-12-06.py
import gc, importlib.util, subprocess, sys

CHILD = r'''
import gc, importlib.util, sys
tracked = sys.argv[1] == "tracked"
if tracked:   # wire_base as committed, but gc=True: every message tracked again
    spec = importlib.util.find_spec("tgw.shm.wire_base")
    src = open(spec.origin).read().replace("gc=False", "gc=True")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tgw.shm.wire_base"] = mod
    exec(compile(src, spec.origin, "exec"), mod.__dict__)
from tgw.shm import wire as w
meta = w.TensorMeta(name="x", dtype="float32", shape=[1, 256])
infer = w.encode(w.Infer(v=2, id=7, model="mlp", inputs=[meta]))
bt = lambda n: w.BlockTensor(name="y", dtype="float32", shape=[n, 10], offset=4096, nbytes=40 * n)
batch = w.encode(w.Batch(batch_id=1, model="mlp", version="1", rows=16, block=3, inputs=[bt(16)], deadline=1.0,
                         splits=[1] * 16, ids=list(range(16))))
done = w.encode(w.Done(batch_id=1, outputs=[bt(16)], block=5, compute_us=120))
reply = w.InferReply(v=2, id=7, model="mlp", version="1", outputs=[w.TensorMeta(name="y", dtype="float32", shape=[1, 10])])
cases = {"Infer (broker decodes, per request)": lambda: w.request_decoder.decode(infer),
         "InferReply (broker makes, per request)": lambda: w.InferReply(v=2, id=7, model="mlp", version="1",
             outputs=[w.TensorMeta(name="y", dtype="float32", shape=[1, 10])]),
         "Batch of 16 (worker decodes, per batch)": lambda: w.to_worker_decoder.decode(batch),
         "Done of 16 (broker decodes, per batch)": lambda: w.from_worker_decoder.decode(done)}
N = 10000
gc.disable()
for name, make in cases.items():
    make()
    held = []
    before = gc.get_count()[0]
    for _ in range(N):
        held.append(make())
    per = (gc.get_count()[0] - before) / N
    print(f"{'tracked' if tracked else 'gc=False'} | {name} | {per:.2f} tracked objects each | message itself tracked: {gc.is_tracked(held[0])}")
    del held
'''
for mode in ("committed", "tracked"):
    print(subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True).stdout, end="")

# the broker's per-request record, as admission makes it
from tgw.broker.state.pending import Pending
p = Pending(client=b"caller", req_id=1, model="mlp", version="1", rows=1, shape_key=(), tensors=[memoryview(b"\0" * 1024)],
            outputs=["y"], deadline=1.0)
print(f"Pending (broker, per request): tracked {gc.is_tracked(p)}; its fields hold the caller object, tenant, version"
      " record, generation and sequence bindings, so a cycle through it is possible: it stays tracked")
