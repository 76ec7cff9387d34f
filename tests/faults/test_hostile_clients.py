"""Hostile and careless callers, with raw sockets against a real broker: slow readers, frames and
lz4 frames that declare or carry more than the limits, too many callers, floods of malformed
frames. The broker's memory stays bounded, every request gets one answer (or, for what the
protocol drops, a counted drop), nothing prints a traceback, and it keeps serving. Each
scenario prints its row of the fault table (tally.py)."""
from __future__ import annotations

import itertools
import resource
import sys

import lz4.frame
import numpy as np
import psutil
import zmq

from conftest import base_config, wait_until
from tally import Tally, row
from tgw.testing.child import Proc
from tgw.client import Client
from tgw.shm.wire import PROTOCOL_VERSION, ErrorReply, Infer, TensorMeta, encode, reply_decoder

X = np.ones((1, 256), np.float32)
_ids = itertools.count(1)


def dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    return s


def infer_header(model: str, name: str, dtype: str, shape: list, compression=None, **kw) -> Infer:
    return Infer(v=PROTOCOL_VERSION, id=next(_ids), model=model, inputs=[
        TensorMeta(name=name, dtype=dtype, shape=shape, compression=compression)], **kw)


def ask(sock: zmq.Socket, header, *frames, wait_s: float = 30.0):
    """Send one raw request and return its decoded reply (None if none came within the bound)."""
    sock.send_multipart([encode(header), *frames])
    return reply_decoder.decode(sock.recv_multipart()[0]) if sock.poll(int(wait_s * 1000)) else None


def code_of(reply) -> str:
    if reply is None:
        return "unanswered"
    return reply.error.code if isinstance(reply, ErrorReply) else "ok"


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def test_slow_reader_replies_are_dropped_and_counted(model_files, make_broker):
    """A caller that asks for 512 KiB replies and never reads: its replies beyond the 1 MiB budget
    are dropped and counted; another caller is served meanwhile."""
    b = make_broker(base_config(model_files, "wide", "mlp", server={"client_queue_bytes": 1 << 20},
                                workers={"output_arena_mb": 8}))
    ctx = zmq.Context()
    slow = dealer(ctx, b.address)
    n = 40
    with Client(b.address) as c:
        before = rss(b.proc.pid)
        for _ in range(n):  # 2 rows of 65,536 float32: 512 KiB per reply
            slow.send_multipart([encode(infer_header("wide", "x", "float32", [2, 1])), np.ones((2, 1), np.float32)])
        stats = wait_until(lambda: (lambda s: s if s["models"]["wide"]["replies"] == n else None)(c.stats()),
                           120, "every request of the slow reader to be computed")
        assert c.infer("mlp", {"x": X})["y"].shape == (1, 10)   # the others are served all along
        grew = rss(b.proc.pid) - before
    dropped = stats["dropped"].get("client_queue_bytes", 0)
    delivered = 0
    while slow.poll(0):  # what was queued for it (within the budget, or in the socket buffer) is still there
        slow.recv_multipart()
        delivered += 1
    t = Tally(f"slow reader, {n} x 512 KiB replies")
    t.extend(["ok"] * delivered + ["dropped"] * dropped)
    row(t, f"budget 1 MiB; broker RSS +{grew >> 20} MiB ({n // 2} MiB would queue without it)")
    assert dropped + delivered == n and dropped >= n // 2
    slow.close()
    ctx.term()


def test_declared_sizes_are_checked_before_anything_is_inflated(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp", server={"max_request_bytes": 4 << 20}))
    ctx = zmq.Context()
    s = dealer(ctx, b.address)
    t = Tally("lz4 bombs and lying headers")
    small = lz4.frame.compress(bytes(1 << 20))   # 4 KiB on the wire, 1 MiB inflated
    cases = {
        # 1 GiB declared: refused from the header, nothing inflated
        "1 GiB declared": ("PAYLOAD_TOO_LARGE", infer_header("mlp", "x", "float32", [1 << 20, 256], "lz4"), small),
        # 2^48 bytes declared (was INTERNAL)
        "2^48 declared": ("PAYLOAD_TOO_LARGE", infer_header("mlp", "x", "float32", [1 << 22, 1 << 24], "lz4"),
                          small),
        # declared 1 KiB, the frame inflates to 1 MiB: stops at the declared size
        "inflates past its shape": ("INVALID_ARGUMENT", infer_header("mlp", "x", "float32", [1, 256], "lz4"), small),
        "too many dims": ("INVALID_INPUT_SHAPE", infer_header("mlp", "x", "float32", [1] * 40), b""),
        "too many elements": ("PAYLOAD_TOO_LARGE", infer_header("mlp", "x", "bool", [1 << 30, 1]), b""),
    }
    before = rss(b.proc.pid)
    for name, (want, header, frame) in cases.items():
        got = t.add(code_of(ask(s, header, frame)))
        assert got == want, name
    got = t.add(code_of(ask(s, infer_header("mlp", "x", "float32", [1, 256]), *[b""] * 100)))
    assert got == "INVALID_ARGUMENT"  # 100 tensor frames: over max_tensors_per_request (64)
    grew = rss(b.proc.pid) - before
    row(t, f"broker RSS +{grew >> 20} MiB")
    assert grew < 64 << 20  # the 1 GiB declared was never allocated
    assert "Traceback" not in b.output()
    s.close()
    ctx.term()


def test_frame_over_the_limit_is_never_received_whole(model_files, make_broker):
    """ZMQ_MAXMSGSIZE: a 64 MiB frame against a 4 MiB limit; libzmq drops that connection
    unread (documented in PROTOCOL.md), and the broker's memory does not grow by the frame."""
    b = make_broker(base_config(model_files, "mlp", server={"max_request_bytes": 4 << 20}))
    ctx = zmq.Context()
    s = dealer(ctx, b.address)
    before = rss(b.proc.pid)
    s.send_multipart([encode(infer_header("mlp", "x", "float32", [65536, 256])), bytes(64 << 20)])
    with Client(b.address) as c:
        # the connection is gone once libzmq has read the frame's size: the count shows it
        wait_until(lambda: c.stats()["clients"]["connected"] == 1, 60, "the oversized caller to be dropped")
        assert c.infer("mlp", {"x": X})["y"].shape == (1, 10)
        grew = rss(b.proc.pid) - before
    t = Tally("one 64 MiB frame, limit 4 MiB")
    t.add("unanswered" if not s.poll(0) else "replied")
    row(t, f"connection dropped unread; broker RSS +{grew >> 20} MiB")
    assert t.unanswered == 1 and grew < 32 << 20
    s.close()
    ctx.term()


def test_requests_in_flight_per_caller_are_capped(model_files, make_broker):
    b = make_broker(base_config(model_files, "spin", server={"max_inflight_per_client": 3},
                                spin={"max_batch_size": 1}))
    ctx = zmq.Context()
    s = dealer(ctx, b.address)
    for _ in range(8):  # each computes ~0.3 s: the first three are still owed when the rest arrive
        s.send_multipart([encode(infer_header("spin", "x", "float32", [1, 1])), np.full((1, 1), 600, np.float32)])
    t = Tally("8 at once, max_inflight_per_client 3")
    for _ in range(8):
        assert s.poll(60_000)
        reply = reply_decoder.decode(s.recv_multipart()[0])
        t.add(code_of(reply))
        if isinstance(reply, ErrorReply):
            assert reply.error.details["reason"] == "client_inflight"
    row(t)
    assert t.ok == 3 and t.errors == {"OVERLOADED": 5}
    s.close()
    ctx.term()


def test_flood_of_malformed_frames_logs_a_few_lines_and_counts_all(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp"))
    ctx = zmq.Context()
    s = dealer(ctx, b.address)
    rng = np.random.default_rng(7)
    n = 2000
    junk = [rng.bytes(int(rng.integers(0, 64))) for _ in range(n // 2)]
    junk += [encode(infer_header("mlp", "x", "float32", [1, 256]))[:k] for k in rng.integers(1, 40, n // 2)]
    t = Tally(f"{n} malformed frames")
    # in floods of 500, each read back before the next: a caller that sent all 2,000 before reading
    # would be a slow reader, whose replies past client_queue_messages (1,000) are dropped by design
    for lo in range(0, n, 500):
        for frame in junk[lo:lo + 500]:
            s.send(frame)
        for _ in junk[lo:lo + 500]:
            t.add(code_of(reply_decoder.decode(s.recv_multipart()[0])) if s.poll(60_000) else "unanswered")
    with Client(b.address) as c:
        refused = c.stats()["refused"]
        assert c.infer("mlp", {"x": X})["y"].shape == (1, 10)
    log = b.output()
    lines = [ln for ln in log.splitlines() if "refused" in ln]
    row(t, f"log lines {len(lines)}, counted {refused}")
    assert t.counts == {"INVALID_ARGUMENT": n}
    assert "Traceback" not in log and len(lines) <= 4 and sum(refused.values()) >= n
    s.close()
    ctx.term()


def test_too_many_callers_are_refused_and_descriptors_never_run_out(model_files, make_broker):
    """A broker whose open-file limit is 200 (hard): 250 callers connect and stay. Those past
    max_clients (20) are told OVERLOADED; past the headroom (16 more) their connections are denied
    at the handshake, so libzmq closes them at once and the crowd never exhausts the descriptors
    (libzmq aborts the process when accept() meets EMFILE); when they leave, callers are served
    again."""
    n, limit = 250, 200
    b = make_broker(base_config(model_files, "mlp", server={"max_clients": 20}), start=False)
    b.argv = [sys.executable, "-c", "import os, resource, sys; n = int(sys.argv[1]); "
              "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); os.execv(sys.executable, sys.argv[2:])",
              str(limit), sys.executable, "-m", "tgw.broker", "start", "--config", b.config_path,
              "--address", b.address]
    Proc.start(b)
    b.wait_ready()
    ours = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (ours[1], ours[1]))  # two descriptors per caller here
    ctx = zmq.Context()
    t = Tally(f"{n} callers, max_clients 20, {limit} fds")
    try:
        with Client(b.address) as watcher:
            socks: list[zmq.Socket] = []
            for _ in range(35):  # one at a time: 19 more fit max_clients, then the headroom (16)
                socks.append(dealer(ctx, b.address))
                t.add(code_of(ask(socks[-1], infer_header("mlp", "x", "float32", [1, 256]), X.tobytes())))
            for i in range(n - 35):  # then a crowd that stays, coming back each second when refused
                socks.append(dealer(ctx, b.address))
                socks[-1].setsockopt(zmq.RECONNECT_IVL, 1000)
                try:  # a denied connection leaves the socket without a peer: sending would block
                    socks[-1].send_multipart([encode(infer_header("mlp", "x", "float32", [1, 256])), X.tobytes()],
                                             zmq.NOBLOCK)
                except zmq.Again:
                    pass
                if i % 10 == 9:  # in waves of 10: a burst larger than the spare descriptors is README's residual
                    try:
                        wait_until(lambda: watcher.stats()["clients"]["denied"] > i, 60, "the wave to be denied")
                    except AssertionError as exc:  # say what the broker saw (a rare failure, seen once)
                        raise AssertionError(f"{exc}; clients {watcher.stats()['clients']}; broker log:\n"
                                             f"{b.output()[-3000:]}") from None
            clients = wait_until(lambda: (lambda c: c if c["denied"] >= n - 35 else None)(
                watcher.stats()["clients"]), 60, "every caller of the crowd to be denied at least once")
            # the crowd: denied, but for the first one or two whose accept was not counted yet
            t.extend(code_of(reply_decoder.decode(s.recv_multipart()[0])) if s.poll(0) else "unanswered"
                     for s in socks[35:])
            for sock in socks:
                sock.close()
            wait_until(lambda: watcher.stats()["clients"]["connected"] <= 1, 60, "the callers to be gone")
            with Client(b.address) as late:   # there is room again
                assert late.infer("mlp", {"x": X})["y"].shape == (1, 10)
    finally:
        ctx.destroy(linger=0)
        resource.setrlimit(resource.RLIMIT_NOFILE, ours)
    row(t, f"connections denied at the handshake: {clients['denied']}")
    assert b.alive() and "Too many open files" not in b.output()
    # the watcher holds one place; a caller's accept may be counted just after its first message
    assert t.ok in (19, 20) and t.ok + t.counts["OVERLOADED"] + t.unanswered == n
    assert t.unanswered >= n - 35 - 2
