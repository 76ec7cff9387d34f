"""Dev microbench: the broker <-> worker doorbell, ZeroMQ ipc against a socketpair.

    .venv/bin/python scripts/doorbell-bench.py [--n 20000] [--window 1,4]

A "broker" on uvloop (reading with add_reader, as broker/front/sockets.py and
broker/fleet/worker_link.py do) sends a Batch-sized message (shm/wire.py Batch of 64 one-row
requests) to a "worker" process that blocks on its socket, decodes it, and answers a Done; the
broker decodes the Done and sends the next batch, keeping `window` batches in flight. Per mode:
the round trip (window 1), messages per second, and the CPU each side spends per round trip
(both processes' CPU, all threads: ZeroMQ's I/O threads count). Modes:
  zmq        today's link: ROUTER (broker) / DEALER (worker) over ipc://
  seqpacket  an AF_UNIX SOCK_SEQPACKET socketpair (a message a datagram; capped at the socket buffer)
  stream     an AF_UNIX SOCK_STREAM socketpair with length-prefixed frames (shm/doorbell.py: what tgw uses)
"""
from __future__ import annotations

import argparse
import asyncio
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time

import uvloop
import zmq

from tgw.shm import doorbell
from tgw.shm.wire import Batch, BlockTensor, Done, encode, from_worker_decoder, to_worker_decoder

ROWS = 64


def batch(i: int) -> bytes:
    return encode(Batch(batch_id=i, model="mlp", version="1", rows=ROWS, block=i % 8,
                        inputs=[BlockTensor(name="x", dtype="FP32", shape=[ROWS, 16], offset=4096 * (i % 8),
                                            nbytes=ROWS * 64)],
                        deadline=time.monotonic() + 30, release=[i % 8], splits=[1] * ROWS,
                        ids=list(range(i * ROWS, (i + 1) * ROWS))))


def done_for(b: Batch) -> bytes:
    return encode(Done(batch_id=b.batch_id, outputs=[BlockTensor(name="y", dtype="FP32", shape=[b.rows, 4],
                                                                  offset=b.block * 1024, nbytes=b.rows * 16)],
                       block=b.block, compute_us=10))


# ---- the worker side: blocking, as workers/mailbox.py reads ------------------------------------

def worker(mode: str, where: str) -> None:
    if mode == "zmq":
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, b"w0")
        s.connect(where)
        s.send(b"hello")
        recv, send = s.recv, s.send
    elif mode == "seqpacket":
        s = socket.socket(fileno=int(where))
        recv, send = (lambda: s.recv(1 << 16)), s.send
    else:
        lane = doorbell.Lane.from_fd(int(where))
        recv, send = lane.recv, lane.send
    cpu0 = None
    while True:
        try:
            data = recv()
        except (doorbell.LaneClosed, zmq.ZMQError):
            break
        if not data or data == b"stop":
            break
        if cpu0 is None:   # from the first batch: start-up is not the link's cost
            cpu0 = time.process_time()
        send(done_for(to_worker_decoder.decode(data)))
    print(f"{time.process_time() - (cpu0 or 0):.6f}", flush=True)


# ---- the broker side: uvloop, add_reader ------------------------------------------------------

async def broker(mode: str, n: int, window: int) -> dict:
    loop = asyncio.get_running_loop()
    finished = loop.create_future()
    state = {"sent": 0, "got": 0}
    tmp = tempfile.mkdtemp()
    if mode == "zmq":
        ctx = zmq.Context()
        r = ctx.socket(zmq.ROUTER)
        r.bind(f"ipc://{tmp}/back")
        proc = subprocess.Popen([sys.executable, __file__, "--worker", mode, f"ipc://{tmp}/back"],
                                stdout=subprocess.PIPE, text=True)
        ident = r.recv_multipart()[0]   # the hello
        fd = r.getsockopt(zmq.FD)

        def send(data):
            r.send_multipart([ident, data], zmq.NOBLOCK)

        def readable():
            try:
                while True:
                    got(r.recv_multipart(zmq.NOBLOCK)[1])
            except zmq.Again:
                pass
    else:
        kind = socket.SOCK_SEQPACKET if mode == "seqpacket" else socket.SOCK_STREAM
        mine, theirs = socket.socketpair(socket.AF_UNIX, kind)
        proc = subprocess.Popen([sys.executable, __file__, "--worker", mode, str(theirs.fileno())],
                                stdout=subprocess.PIPE, text=True, pass_fds=(theirs.fileno(),))
        theirs.close()
        mine.setblocking(False)
        fd = mine.fileno()
        inbox = doorbell.Inbox()
        if mode == "seqpacket":
            def send(data):
                mine.send(data)

            def readable():
                try:
                    while True:
                        got(mine.recv(1 << 16))
                except BlockingIOError:
                    pass
        else:
            def send(data):
                mine.send(doorbell.frame(data))   # small: all of it fits the socket buffer here

            def readable():
                try:
                    inbox.fill(mine)
                except BlockingIOError:
                    return
                while (msg := inbox.take()) is not None:
                    got(msg)

    def got(data):
        from_worker_decoder.decode(data)
        state["got"] += 1
        if state["sent"] < n:
            state["sent"] += 1
            send(batch(state["sent"]))
        elif state["got"] == n and not finished.done():
            finished.set_result(None)

    loop.add_reader(fd, readable)
    if mode == "zmq":
        loop.call_soon(readable)   # ZeroMQ's FD is edge-triggered
    warm = [batch(i) for i in range(window)]
    cpu0, t0 = time.process_time(), time.perf_counter()
    for data in warm:
        state["sent"] += 1
        send(data)
    if mode == "zmq":
        loop.call_soon(readable)
    await finished
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    loop.remove_reader(fd)
    if mode == "zmq":
        send(b"stop")
    else:
        mine.close()   # the worker reads EOF: how a worker sees the broker gone
    out, _ = proc.communicate(timeout=30)
    if mode == "zmq":
        r.close(linger=0)
        ctx.term()
    return {"wall_s": wall, "broker_cpu_s": cpu, "worker_cpu_s": float(out.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="round trips per mode and window")
    ap.add_argument("--window", default="1,4", help="batches in flight, comma-separated")
    ap.add_argument("--modes", default="zmq,seqpacket,stream")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    print(f"# {' '.join(sys.argv)}")
    print(f"# {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}; Batch {len(batch(1))} B, "
          f"Done {len(done_for(to_worker_decoder.decode(batch(1))))} B; n={args.n}")
    print(f"{'mode':10} {'window':>6} {'round trip us':>14} {'msgs/s':>9} {'broker cpu us':>14} "
          f"{'worker cpu us':>14}")
    for window in (int(w) for w in args.window.split(",")):
        for mode in args.modes.split(","):
            r = uvloop.run(broker(mode, args.n, window))
            per = 1e6 / args.n
            print(f"{mode:10} {window:>6} {r['wall_s'] * per * window:>14.1f} {args.n / r['wall_s']:>9.0f} "
                  f"{r['broker_cpu_s'] * per:>14.1f} {r['worker_cpu_s'] * per:>14.1f}", flush=True)
    print("# round trip: wall per batch x window (the latency each batch sees); cpu: per round trip, "
          "each process whole, all its threads")


if __name__ == "__main__":
    main()
