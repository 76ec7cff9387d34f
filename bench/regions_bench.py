"""Shared-memory regions vs the socket: 602 KB float32 inputs (the demo resnet declared
[3,224,224]) from c closed-loop callers, once with the tensor in a frame and once in a client
region (docs/PROTOCOL.md 5.9). Prints req/s and CPU µs per request of the broker (all its
threads) and of the callers' process, for each, and the ratios; plus what a 602 KB copy out of
a region costs (the broker's copy into the ring, which a worker reading the region in place
would save: it still needs a batch's rows in one block).

    .venv/bin/python -m tgw.bench.regions_bench [--duration 10] [--concurrency 16] [--workers 1]

`Caller` (one DEALER per thread, region= on infer) is also what tests/process/test_regions.py drives.
"""
from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time

import numpy as np
import psutil
import zmq

from tgw.broker.child import BrokerProc
from tgw.bench.comparison import demo_models
from tgw.client.regions import Region, output_bytes_for
from tgw.client.request import prepare
from tgw.shm.errors import error_from_body, fail, Code
from tgw.shm.wire import ErrorReply, encode, reply_decoder

SHAPE = (1, 3, 224, 224)           # 602,112 bytes of float32


class Caller:
    """A minimal synchronous caller: one DEALER socket per thread, infer with or without a region."""

    def __init__(self, address: str, token: str | None = None):
        self.address, self.token = address, token
        self.ctx = zmq.Context()
        self.local = threading.local()
        self.ids = itertools.count(1)
        self.lock = threading.Lock()
        self.socks: list = []

    def sock(self) -> zmq.Socket:
        s = getattr(self.local, "sock", None)
        if s is None:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.address)
            with self.lock:
                self.socks.append(s)
            self.local.sock = s
        return s

    def call(self, msg, frames=(), timeout: float = 60.0):
        """(reply, tensor frames); an error reply raises its TgwError."""
        reply, parts = self.exchange(msg, frames, timeout)
        if isinstance(reply, ErrorReply):
            raise error_from_body(reply.error)
        return reply, parts

    def exchange(self, msg, frames=(), timeout: float = 60.0):
        """(reply, tensor frames), the reply an ErrorReply too; no reply in time: DEADLINE_EXCEEDED."""
        s = self.sock()
        s.send_multipart([encode(msg), *frames], copy=False)
        deadline = time.monotonic() + timeout
        while True:
            if not s.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                raise fail(Code.DEADLINE_EXCEEDED, f"no reply within {timeout}s", source="client")
            parts = s.recv_multipart(copy=False)
            reply = reply_decoder.decode(parts[0].buffer)
            if reply.id != msg.id:
                continue
            return reply, parts[1:]

    def send(self, msg):
        """Region's `send`: sets the request's id and token, returns the reply."""
        msg.id, msg.token = next(self.ids), self.token
        return self.call(msg)[0]

    def region(self, nbytes: int, **options) -> Region:
        return Region(self.send, nbytes, **options)

    def infer(self, model: str, inputs: dict, region: Region | None = None, timeout: float = 60.0, **options):
        call = prepare(next(self.ids), model, inputs, token=self.token, default_tenant=None, address=self.address,
                       region=region, timeout=timeout, **options)
        answered = False
        try:
            reply, frames = self.exchange(call.msg, call.frames, timeout + 1.0)
            answered = True     # any reply: the broker will not write the call's output slice again
            if isinstance(reply, ErrorReply):
                raise error_from_body(reply.error)
            return call.outputs(reply, frames)
        finally:
            if call.slots is not None:
                region.release(call.slots, answered)
                call.slots = None

    def close(self) -> None:
        for s in self.socks:
            s.close(linger=0)
        self.ctx.term()


def copy_us(n: int = SHAPE[1] * SHAPE[2] * SHAPE[3] * 4, rounds: int = 300) -> float:
    """Median µs of one copy of `n` bytes from a memfd mapping into another mapping (region -> ring)."""
    fd = os.memfd_create("tgw-copy-probe")
    os.ftruncate(fd, n)
    src = mmap.mmap(fd, n)
    dst = mmap.mmap(-1, n)
    src[:] = os.urandom(n)
    s, d, times = memoryview(src), memoryview(dst), []
    for _ in range(rounds):
        t = time.perf_counter()
        d[0:n] = s[0:n]
        times.append(time.perf_counter() - t)
    s.release(), d.release(), src.close(), dst.close(), os.close(fd)
    return statistics.median(times) * 1e6


def row(caller: Caller, broker: psutil.Process, concurrency: int, duration: float, warmup: float,
        region: Region | None) -> dict:
    x = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    stop, counts, errors = threading.Event(), [0] * concurrency, []
    window = {"on": False}

    def run(i: int) -> None:
        while not stop.is_set():
            try:
                caller.infer("resnet224", {"image": x}, region=region)
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))
                continue
            if window["on"]:
                counts[i] += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    me = psutil.Process()
    time.sleep(warmup)
    b0, c0, t0 = sum(broker.cpu_times()[:2]), sum(me.cpu_times()[:2]), time.perf_counter()
    window["on"] = True
    time.sleep(duration)
    window["on"] = False
    b1, c1, t1 = sum(broker.cpu_times()[:2]), sum(me.cpu_times()[:2]), time.perf_counter()
    n = sum(counts)
    stop.set()
    for t in threads:
        t.join(120)
    return {"path": "region" if region is not None else "socket", "requests": n, "seconds": round(t1 - t0, 3),
            "rps": n / (t1 - t0), "broker_us_per_req": (b1 - b0) / n * 1e6 if n else None,
            "callers_us_per_req": (c1 - c0) / n * 1e6 if n else None, "errors": len(errors),
            "first_error": errors[0] if errors else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=10.0, help="seconds measured per row (default 10)")
    p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--workers", type=int, default=1, help="CPU workers (default 1)")
    p.add_argument("--rounds", type=int, default=2, help="socket, region alternations (default 2)")
    p.add_argument("--json", help="write the rows to this file")
    a = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="tgwr-", dir="/tmp")
    broker = caller = region = None
    try:
        models = demo_models(os.path.join(work, "models"))
        r = models["resnet224"]
        cfg = {"server": {"max_request_bytes": 64 << 20},
               "workers": {"devices": ["cpu"] * a.workers, "threads_per_worker": 1},
               "models": [{"name": "resnet224", "versions": [{"version": "1", "path": r["path"]}],
                           "inputs": r["inputs"], "outputs": r["outputs"], "max_batch_size": 16,
                           "max_queue": 4096, "timeout_ms": 60000, "warmup_batch_sizes": [1]}]}
        broker = BrokerProc(cfg, work).start(timeout=180)
        caller = Caller(broker.address)
        per_call = output_bytes_for([SHAPE[1] * SHAPE[2] * SHAPE[3] * 4]) + output_bytes_for([1000 * 4])
        region = caller.region(2 * a.concurrency * per_call, output_bytes=output_bytes_for([1000 * 4]))
        bp = psutil.Process(broker.pid)
        rows = []
        for _ in range(a.rounds):
            for reg in (None, region):
                rows.append(row(caller, bp, a.concurrency, a.duration, a.warmup, reg))
                print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in rows[-1].items()}),
                      flush=True)
        sock = [x for x in rows if x["path"] == "socket"]
        reg = [x for x in rows if x["path"] == "region"]
        mean = lambda rs, k: statistics.mean(x[k] for x in rs)  # noqa: E731
        summary = {"concurrency": a.concurrency, "input_bytes": SHAPE[1] * SHAPE[2] * SHAPE[3] * 4,
                   "socket_rps": mean(sock, "rps"), "region_rps": mean(reg, "rps"),
                   "socket_broker_us": mean(sock, "broker_us_per_req"),
                   "region_broker_us": mean(reg, "broker_us_per_req"),
                   "socket_callers_us": mean(sock, "callers_us_per_req"),
                   "region_callers_us": mean(reg, "callers_us_per_req"),
                   "copy_602kb_us": copy_us(), "region_stats": _region_stats(caller)}
        summary["rps_ratio_region_over_socket"] = summary["region_rps"] / summary["socket_rps"]
        summary["broker_cpu_ratio_region_over_socket"] = summary["region_broker_us"] / summary["socket_broker_us"]
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}, indent=1))
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"rows": rows, "summary": summary}, f, indent=1)
        return 0
    finally:
        if region is not None:
            region.close()
        if caller is not None:
            caller.close()
        if broker is not None:
            broker.stop()
        shutil.rmtree(work, ignore_errors=True)


def _region_stats(caller: Caller) -> dict:
    from tgw.shm.wire import PROTOCOL_VERSION, Stats
    return dict(caller.send(Stats(v=PROTOCOL_VERSION)).regions)


if __name__ == "__main__":
    raise SystemExit(main())
