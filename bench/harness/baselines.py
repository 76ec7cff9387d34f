"""The three systems tgw is compared with (bench/README.md says what each row measures).

* In-process floor (`run_floors`): the model file called directly on the load generator's
  inputs in spawned copies, one torch thread each, frozen as tgw's worker does, timing each batch
  size in lockstep. module="served" (the formats scenario), or a declaration whose "format" is
  export or aoti, loads it with the worker's own `load_in_process` instead. `device` runs it on a
  GPU (the gpu scenario): inputs already there, or with from_host=True copied there and the
  outputs back per call, synchronized after each call.
* Transport floor (`EchoServer`): a raw pyzmq ROUTER broker -> DEALER worker echo over ipc://
  (`echo_main`, each in a process of its own); the worker replies with as many bytes as the
  request's 8-byte header asks for (the model's output size).
* The seed design (`FlaskServer`): Flask + `torch.jit.load` (not frozen, as the seed did), the
  KServe v2 JSON bodies tgw's HTTP face takes, gunicorn sync workers with one torch thread each,
  on 127.0.0.1; a model declared with a "device" (the gpu scenario) runs there. `GunicornServer`
  runs any Flask app factory so.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import resource
import signal
import socket
import struct
import sys
import time
import urllib.request
from typing import Any, Callable, Optional

import numpy as np
import zmq

from tgw.bench.harness.loadgen import cpu_seconds
from tgw.bench.harness.targets import make_inputs, v2_datatype
from tgw.testing.child import Proc

# ---- the in-process floor ----------------------------------------------------------------------

def _load(path: str, how: str, fmt: Optional[str] = None, device: str = "cpu"):
    """(callable, how it was loaded). how="served", or a file that is not TorchScript: exactly
    the program tgw's worker serves (`load_in_process`); otherwise the TorchScript file frozen
    (or not) as `how` says."""
    import torch
    if how == "served" or fmt not in (None, "torchscript"):
        from tgw.workers.formats import load_in_process
        return load_in_process(fmt or "torchscript", path, torch.device(device)).call, \
            f"{fmt or 'torchscript'}, as the worker loads it"
    module = torch.jit.load(path, map_location=device).eval()
    if how == "none":
        return module, "as loaded"
    try:
        module = torch.jit.freeze(module)
        if how == "optimize":
            return torch.jit.optimize_for_inference(module), "frozen+optimize_for_inference"
        return module, "frozen"
    except Exception as exc:  # noqa: BLE001 - some scripted modules cannot be frozen
        return module, f"as loaded (freeze failed: {type(exc).__name__})"


def _step(module, x: list, device: str, from_host: bool) -> Callable[[], Any]:
    """One timed call. On a GPU it ends with a synchronize; from_host: the inputs (x, on the host)
    are copied to the device first and the outputs back after."""
    import torch
    if device == "cpu":
        return lambda: module(*x)
    dev = torch.device(device)
    if not from_host:
        x = [t.to(dev) for t in x]

        def call():
            module(*x)
            torch.cuda.synchronize(dev)
        return call

    def call_from_host():
        out = module(*[t.to(dev, non_blocking=True) for t in x])
        for t in out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else [out]:
            t.to("cpu", non_blocking=True)   # as the worker brings them back
        torch.cuda.synchronize(dev)
    return call_from_host


def _copy(model: dict[str, Any], how: str, batches: list[int], seconds: float, warmup: float, barrier,
          results, device: str = "cpu", from_host: bool = False) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops the copies
    import torch
    torch.set_num_threads(1)
    module, how = _load(model["path"], how, model.get("format"), device)
    out = []
    with torch.inference_mode():
        for b in batches:
            call = _step(module, [torch.from_numpy(v) for v in make_inputs(model, b).values()], device, from_host)
            barrier.wait()
            # at least 3 calls: TorchScript's profiling executor optimises on the second run
            end, n = time.perf_counter() + warmup, 0
            while n < 3 or time.perf_counter() < end:
                call()
                n += 1
            barrier.wait()
            lat, t_start = [], time.perf_counter()
            while len(lat) < 5 or time.perf_counter() < t_start + seconds:
                t0 = time.perf_counter()
                call()
                lat.append(time.perf_counter() - t0)
            out.append({"batch": b, "lat": lat, "elapsed": time.perf_counter() - t_start})
    results.put({"module": how, "torch": torch.__version__, "runs": out})


def measure_floor(model: dict[str, Any], seconds: float, procs: int, module: str = "freeze", device: str = "cpu",
                  from_host: bool = False) -> dict[str, Any]:
    """One round for one model (a demo declaration: path, inputs, max_batch_size, optionally format);
    device/from_host: see _step."""
    import psutil
    top = model["max_batch_size"]
    batches = sorted({1, max(1, top // 4), top})
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(procs, timeout=300), ctx.Queue()
    args = (model, module, batches, seconds, min(1.0, seconds / 2), barrier, results, device, from_host)
    machine0, child0, t0 = psutil.cpu_times(), cpu_seconds(resource.RUSAGE_CHILDREN), time.monotonic()
    copies = [ctx.Process(target=_copy, args=args, daemon=True) for _ in range(procs)]
    out: list[dict] = []
    try:
        for p in copies:
            p.start()
        while len(out) < procs:
            try:
                out.append(results.get(timeout=1))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in copies):
                    raise RuntimeError(f"a floor copy exited with {[p.exitcode for p in copies]}") from None
    finally:
        for p in copies:
            p.join(10)
            if p.is_alive():
                p.terminate()  # by PID, only the copies started here
                p.join(5)
    machine1, child1, wall = psutil.cpu_times(), cpu_seconds(resource.RUSAGE_CHILDREN), time.monotonic() - t0
    runs = []
    for i, b in enumerate(batches):
        ms = np.concatenate([c["runs"][i]["lat"] for c in out]) * 1e3
        calls_per_s = sum(len(c["runs"][i]["lat"]) / c["runs"][i]["elapsed"] for c in out)
        runs.append({"batch": b, "calls": int(ms.size), "calls_per_s": calls_per_s, "samples_per_s": calls_per_s * b,
                     "latency_ms": {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
                                    "mean": float(ms.mean())}})
    busy_cores = max(0.0, (sum(machine1) - sum(machine0) - (machine1.idle - machine0.idle)) / wall)
    return {"path": model["path"], "procs": procs, "threads": 1, "module": out[0]["module"],
            "device": device, "from_host": from_host, "torch": out[0]["torch"], "runs": runs,
            "background_cpu_cores": max(0.0, busy_cores - (child1 - child0) / wall)}


def run_floors(models: dict[str, dict], names: list[str], seconds: float, procs: int, log: Callable[[str], None],
               previous: Optional[dict[str, Any]] = None, module: str = "freeze") -> dict[str, Any]:
    """model -> measure_floor()'s result (per batch size the best of this round and `previous`) or
    {"error": ...}."""
    out: dict[str, Any] = {}
    for name in names:
        prev = (previous or {}).get(name)
        try:
            res = measure_floor(models[name], seconds, procs, module=module)
        except Exception as exc:  # noqa: BLE001 - record and go on
            out[name] = prev or {"error": f"{type(exc).__name__}: {exc}"}
            log(f"in-process floor {name} FAILED: {type(exc).__name__}: {exc}")
            continue
        b1, bmax = res["runs"][0], res["runs"][-1]
        log(f"in-process floor {name}: batch 1 {b1['samples_per_s']:,.0f} sps (p50 {b1['latency_ms']['p50']:.3f} ms), "
            f"batch {bmax['batch']} {bmax['samples_per_s']:,.0f} sps; background load "
            f"{res['background_cpu_cores']:.2f} cores")
        if prev and "error" not in prev:  # the batch sizes are the same in every round
            res = {**prev, "rounds": prev.get("rounds", 1) + 1,
                   "runs": [max(a, b, key=lambda r: r["samples_per_s"]) for a, b in zip(prev["runs"], res["runs"])],
                   "background_cpu_cores": min(prev["background_cpu_cores"], res["background_cpu_cores"])}
        out[name] = res
    return out


def floor_row(floor: dict[str, Any]) -> dict[str, Any]:
    """A table row: req/s = the best samples/s over the batch sizes, latency = one batch-1 call."""
    if "error" in floor:
        return floor
    b1 = floor["runs"][0]  # runs are sorted by batch size
    best = max(floor["runs"], key=lambda r: r["samples_per_s"])  # large batches are not always faster
    bg = floor["background_cpu_cores"]
    return {"throughput_rps": best["samples_per_s"], "rows_per_s": best["samples_per_s"],
            "latency_ms": {"p50": b1["latency_ms"]["p50"], "p90": None, "p99": b1["latency_ms"]["p99"], "p99_9": None},
            "requests_failed": 0, "errors": {}, "machine": {"other_cpu_cores": bg},
            "floor": {"best_batch": best["batch"], "procs": floor["procs"], "module": floor.get("module"),
                      "rounds": floor.get("rounds", 1)},
            "warnings": [f"other processes used {bg:.2f} cores while the floor was measured"] if bg >= 0.25 else []}


class Server:
    """Subprocesses started together, ready once `ready()` is true, stopped by PID in reverse order."""

    def __init__(self, procs: list[Proc], ready: Callable[[], bool], timeout: float, env: dict | None = None):
        self.procs = procs
        try:
            for p in procs:
                p.start(env)
            procs[0].wait_for(ready, timeout, f"{procs[0].name} ready")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop(timeout=10)


# ---- the transport floor -----------------------------------------------------------------------

def run_broker(front_addr: str, back_addr: str) -> None:
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (front, back):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)  # a full ROUTER drops messages: no limit, as in tgw's broker
        s.setsockopt(zmq.RCVHWM, 0)
    front.bind(front_addr)
    back.bind(back_addr)
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll():
            dst = back if sock is front else front
            for _ in range(256):  # drain the socket without blocking, as tgw's broker does
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                dst.send_multipart(frames, copy=False)


def run_worker(back_addr: str) -> None:
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(back_addr)
    replies: dict[int, bytes] = {}
    while True:
        ident, header, _payload = sock.recv_multipart(copy=False)
        n = struct.unpack("<Q", header.bytes)[0]
        sock.send_multipart([ident, replies.setdefault(n, bytes(n))], copy=False)


def echo_main() -> None:
    """The transport echo's process: `python -c ...echo_main()` broker FRONT BACK | worker BACK."""
    role, *addresses = sys.argv[1:] or [""]
    serve = {"broker": run_broker, "worker": run_worker}.get(role)
    if serve is None or len(addresses) != (2 if role == "broker" else 1):
        sys.exit("usage: echo_main broker FRONT BACK | worker BACK")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    serve(*addresses)


class EchoServer(Server):
    """The echo broker and one worker in `workdir`; clients connect to `front`."""

    def __init__(self, workdir: str):
        self.front, back = f"ipc://{workdir}/echo-front.sock", f"ipc://{workdir}/echo-back.sock"
        py = [sys.executable, "-c", "from tgw.bench.harness.baselines import echo_main; echo_main()"]
        self.broker = Proc([*py, "broker", self.front, back], os.path.join(workdir, "echo-broker.log"), "echo broker")
        self.worker = Proc([*py, "worker", back], os.path.join(workdir, "echo-worker.log"), "echo worker")
        super().__init__([self.broker, self.worker], self._ping, 30)
        self.processes = [{"role": "broker", "pid": self.broker.pid, "device": "-"},
                          {"role": "worker", "pid": self.worker.pid, "device": "-"}]

    def _ping(self) -> bool:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(self.front)
            s.send_multipart([struct.pack("<Q", 1), b"x"])
            return bool(s.poll(500)) and s.recv_multipart() == [b"\0"]
        finally:
            s.close(0)


# ---- the seed design: Flask + gunicorn -----------------------------------------------------------

FLASK_MODELS_ENV = "TGW_BENCH_FLASK_MODELS"


def create_app():
    """gunicorn's app factory (`tgw.bench.harness.baselines:create_app()`); the models come in the environment.
    It takes the body tgw's HTTP face takes, a KServe v2 JSON request (`{"inputs": [{name, shape,
    datatype, data (flat)}]}`), as a typical Flask server would: Flask's JSON, then
    `torch.tensor(data, dtype).reshape(shape)` per input, and answers in the v2 shape (`outputs`
    with flat `data` lists)."""
    import torch
    from flask import Flask, jsonify, request

    torch.set_num_threads(1)
    models = {name: (torch.jit.load(d["path"], map_location=d.get("device", "cpu")).eval(), d["inputs"], d["outputs"],
                     d.get("device", "cpu"))
              for name, d in json.loads(os.environ[FLASK_MODELS_ENV]).items()}
    app = Flask("tgw-bench-flask")

    @app.get("/health")
    def health():
        return jsonify({"ready": True, "models": sorted(models)})

    @app.post("/v2/models/<name>/infer")
    def infer(name: str):
        module, inputs, outputs, device = models[name]
        body = {i["name"]: i for i in request.get_json(force=True)["inputs"]}
        with torch.inference_mode():
            out = module(*[torch.tensor(body[d["name"]]["data"], dtype=getattr(torch, d["dtype"]), device=device)
                           .reshape(body[d["name"]]["shape"]) for d in inputs])
        # the demo models return one tensor or a dict of them; .tolist() below brings a GPU's back
        out = out if isinstance(out, dict) else {outputs[0]["name"]: out}
        return jsonify({"model_name": name, "outputs": [
            {"name": k, "datatype": v2_datatype(v.dtype), "shape": list(v.shape), "data": v.flatten().tolist()}
            for k, v in out.items()]})

    return app


class GunicornServer(Server):
    """A Flask app (`app`: gunicorn's "module:create_app()") under gunicorn with `workers` sync
    workers on a free 127.0.0.1 port, ready once every worker answers /health; `env` configures it."""

    def __init__(self, app: str, workers: int, workdir: str, log_name: str, env: dict[str, str], device: str = "cpu"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.master = Proc([sys.executable, "-m", "gunicorn", "-w", str(workers), "-k", "sync",
                            "-b", f"127.0.0.1:{self.port}", "--timeout", "300", "--graceful-timeout", "5",
                            "--log-level", "warning", app], os.path.join(workdir, log_name), "gunicorn")
        self.device = device
        super().__init__([self.master], lambda: self._workers_ready(workers), 120,
                         env={**env, "PYTHONUNBUFFERED": "1"})

    def _workers_ready(self, n: int) -> bool:
        # each worker loads torch and the models when it starts: n workers, several answers
        if len(self.processes) < n + 1:
            return False
        for _ in range(4 * n):
            urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5).close()  # raises unless 2xx
        return True

    @property
    def processes(self) -> list[dict[str, Any]]:
        import psutil
        procs = [{"role": "gunicorn-master", "pid": self.master.pid, "device": "cpu"}]
        try:
            procs += [{"role": "gunicorn-worker", "pid": c.pid, "device": self.device}
                      for c in psutil.Process(self.master.pid).children()]
        except psutil.Error:
            pass
        return procs


class FlaskServer(GunicornServer):
    def __init__(self, models: dict[str, dict[str, Any]], workers: int, workdir: str):
        """models: name -> {"path": file, "inputs"/"outputs": [{"name", "dtype", ...}], ...} (the demo
        declarations), optionally "device" (default cpu): where each gunicorn worker runs it."""
        decl = {n: {k: m[k] for k in ("path", "inputs", "outputs", "device") if k in m} for n, m in models.items()}
        super().__init__("tgw.bench.harness.baselines:create_app()", workers, workdir, "gunicorn.log",
                         {FLASK_MODELS_ENV: json.dumps(decl)},
                         ",".join(sorted({m.get("device", "cpu") for m in models.values()})))
