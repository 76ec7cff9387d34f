"""Where a front's input tensor should leave the fronts socket for its region (broker/fronts/
region.py THRESHOLD): the cost of one tensor crossing a DEALER -> ROUTER ipc:// link as a frame
(link.py's send: copied below 64 KiB, zero-copy above; the ROUTER's receive) against copying it
into a memfd mapping and sending an empty frame, by size. One process, both ends, the same loop
of N messages sent then read; prints a table (microseconds per tensor).

    python bench/front_region_threshold.py [--n 2000] > bench/results/front-region-threshold.txt
"""
from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time

import zmq

COPY_BELOW = 1 << 16   # fronts/link.py's


def run(n: int, size: int, region: bool, ctx: zmq.Context, path: str) -> float:
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    router.bind(f"ipc://{path}")
    dealer.connect(f"ipc://{path}")
    fd = os.memfd_create("bench")
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size)
    view = memoryview(mm)
    data = memoryview(os.urandom(size))
    header = b"h" * 120
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            if region:
                view[:size] = data
                dealer.send_multipart([b"i", header, b""])
            else:
                dealer.send(b"i", zmq.SNDMORE)
                dealer.send(header, zmq.SNDMORE)
                dealer.send(data, copy=size < COPY_BELOW)
            frames = router.recv_multipart(copy=False)
            assert len(frames) == 4
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    view.release()
    mm.close()
    os.close(fd)
    router.close()
    dealer.close()
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000)
    args = p.parse_args()
    ctx = zmq.Context()
    d = tempfile.mkdtemp(prefix="tgwrt-", dir="/tmp")
    print(f"# python bench/front_region_threshold.py --n {args.n}   (us per tensor, best of 3 runs of {args.n})")
    print(f"{'bytes':>9} {'frame_us':>9} {'region_us':>10}")
    for size in (4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 256 << 10, 1 << 20):
        frame = run(args.n, size, False, ctx, os.path.join(d, f"f{size}"))
        region = run(args.n, size, True, ctx, os.path.join(d, f"r{size}"))
        print(f"{size:>9} {frame:>9.1f} {region:>10.1f}")
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
