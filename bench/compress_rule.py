"""The figures behind tgw.shm.compression's rule (`python -m tgw.bench.compress_bench --rule`):
lz4's cost per MiB on tensors of several compressibilities, the links' one-way cost per MiB (a
ROUTER echo over ipc://, tcp:// and tcp:// with CURVE), and for each ratio the link cost at which
compressing breaks even."""
from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time

import lz4.frame
import numpy as np
import zmq

ELEMENTS = 1 << 20            # float32: 4 MiB
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_s(f, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[reps // 2]


def lz4_table(rng: np.random.Generator) -> list[tuple[str, float, float]]:
    """(data, lz4 ratio, compress + decompress microseconds per MiB of raw bytes)."""
    n = ELEMENTS
    kinds = [("zeros", np.zeros(n, np.float32))]
    for zf in (0.99, 0.95, 0.9, 0.8, 0.7, 0.5, 0.3):
        kinds.append((f"{zf:.0%} zeros", np.where(rng.random(n) < zf, 0, rng.standard_normal(n)).astype(np.float32)))
    for r in (64, 16, 4):
        kinds.append((f"repeat x{r}", np.repeat(rng.standard_normal(n // r), r).astype(np.float32)))
    kinds += [("relu(noise)", np.maximum(rng.standard_normal(n), 0).astype(np.float32)),
              ("uint8 image/255", (rng.integers(0, 256, n) / 255).astype(np.float32)),
              ("smooth (sin)", np.sin(np.linspace(0, 100, n)).astype(np.float32)),
              ("noise", rng.standard_normal(n, dtype=np.float32))]
    out = []
    for name, a in kinds:
        raw = memoryview(a).cast("B")
        packed = lz4.frame.compress(raw)
        c = _median_s(lambda: lz4.frame.compress(raw), 7)
        d = _median_s(lambda: lz4.frame.decompress(packed), 7)
        out.append((name, len(packed) / raw.nbytes, (c + d) / (raw.nbytes / MiB) * 1e6))
    return out


def _echo(sock: zmq.Socket) -> None:
    while True:
        parts = sock.recv_multipart(copy=False)
        if parts[-1].bytes == b"stop":
            return
        sock.send_multipart([parts[0], b"ok"])


def link_cost(address: str, curve: bool, size: int = 4 * MiB, reps: int = 30) -> float:
    """One-way microseconds per MiB: a `size` message and an empty one echoed, the difference."""
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    client = ctx.socket(zmq.DEALER)
    for s in (server, client):
        s.setsockopt(zmq.LINGER, 0)
    if curve:
        pub, secret = zmq.curve_keypair()
        server.curve_publickey, server.curve_secretkey = pub, secret
        server.curve_server = True
        client.curve_publickey, client.curve_secretkey = zmq.curve_keypair()
        client.curve_serverkey = pub
    server.bind(address)
    t = threading.Thread(target=_echo, args=(server,), daemon=True)
    t.start()
    client.connect(address)
    data, empty = np.ones(size, np.uint8), b"x"

    def once(payload) -> None:
        client.send(payload, copy=False)
        client.recv()
    for _ in range(3):
        once(data)
    big = _median_s(lambda: once(data), reps)
    small = _median_s(lambda: once(empty), reps)
    client.send(b"stop")
    t.join(10)
    client.close()
    server.close()
    ctx.term()
    return (big - small) / (size / MiB) * 1e6


def rule(rng: np.random.Generator) -> None:
    d = tempfile.mkdtemp(prefix="tgwl-", dir="/tmp")
    try:
        links = [("ipc://", link_cost(f"ipc://{d}/echo.sock", False)),
                 ("tcp:// loopback", link_cost(f"tcp://127.0.0.1:{free_port()}", False)),
                 ("tcp:// CURVE loopback", link_cost(f"tcp://127.0.0.1:{free_port()}", True))]
    finally:
        shutil.rmtree(d, ignore_errors=True)
    links.append(("1 Gb/s network (computed)", MiB * 8 / 1e9 * 1e6))
    print("link one-way cost per MiB:")
    for name, us in links:
        print(f"  {name:26} {us:7.0f} us/MiB")
    print("\nlz4 on 4 MiB of float32 (compress + decompress, per MiB of raw bytes); compressing pays on a link "
          "costing more than 'break-even':")
    print(f"  {'data':16} {'ratio':>6} {'lz4 us/MiB':>10} {'break-even':>10}   pays on")
    for name, ratio, us in lz4_table(rng):
        even = us / (1 - ratio) if ratio < 1 else float("inf")
        pays = ", ".join(n.split(" (")[0] for n, cost in links if cost > even) or "-"
        print(f"  {name:16} {ratio:6.3f} {us:10.0f} {even:10.0f}   {pays}")
