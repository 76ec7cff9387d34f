"""What lz4 (`compress=True`, `"auto"`) and reduced wire precision (`wire_dtype`) do to one
4 MiB float32 request: bytes on the wire and end-to-end time, over ipc:// and tcp:// (CURVE).

    tgw-bench compress            # the end-to-end table (ipc and tcp)
    tgw-bench compress --rule     # the figures behind tgw.shm.compression's rule

The end-to-end rows start a broker (one CPU worker) serving a model built here (`y = 2x`,
x: float32 [1048576], declared with `wire_dtypes: [float16, bfloat16]`), and send it, one at a
time from one caller, a compressible tensor (each value repeated 16 times: lz4 shrinks it to
~12 %) and an incompressible one (normal noise). A request is what Client.infer does: encode
(narrow, compress), send, wait, decode (inflate); its bytes are the request's tensor frames plus
the reply's. "auto" is what a client sends on that link (off over ipc://); "auto, rule forced"
applies the size/ratio rule whatever the link, to show what it would cost there.
`--rule` times lz4 (compress + decompress, per MiB of raw bytes) on tensors of several
compressibilities, and the link (one-way, per MiB: a ROUTER echo over ipc://, tcp:// and tcp://
with CURVE), and prints for each ratio the link cost at which compressing breaks even.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
import threading
import time

import lz4.frame
import numpy as np
import zmq

from tgw.client.tensors import decode_outputs, encode, from_bfloat16_bits, to_bfloat16_bits
from tgw.shm.compression import for_address
from tgw.shm.wire import PROTOCOL_VERSION, ErrorReply, Infer, encode as encode_msg, reply_decoder
from tgw.testing.child import BrokerProc

NAME = "compress"
HELP = "lz4 and reduced wire precision on a 4 MiB tensor over ipc and tcp (--rule: the figures behind compress='auto')"
ELEMENTS = 1 << 20            # float32: 4 MiB
MiB = 1 << 20

VARIANTS = [                  # label, compress, wire_dtype (compress "link-auto": what a client asks on that link)
    ("raw", False, None),
    ("lz4 (compress=True)", True, None),
    ("compress=auto", "link-auto", None),
    ("auto, rule forced", "auto", None),
    ("wire_dtype=float16", False, "float16"),
    ("wire_dtype=bfloat16", False, "bfloat16"),
    ("bfloat16 + auto", "link-auto", "bfloat16"),
    ("bfloat16 + auto forced", "auto", "bfloat16"),
]


def datasets(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"repeat16": np.repeat(rng.standard_normal(ELEMENTS // 16), 16).astype(np.float32)[None],
            "noise": rng.standard_normal(ELEMENTS, dtype=np.float32)[None]}


# ---- the broker ----------------------------------------------------------------------------------

def build_model(path: str) -> None:
    import torch   # the bench builds its own model (nothing is downloaded)

    class Double(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2.0

    torch.jit.save(torch.jit.script(Double()), path)


def start_broker(workdir: str, model: str, tcp: bool) -> tuple[BrokerProc, bytes | None]:
    """A broker on ipc:// or on tcp:// (CURVE); its address's server public key (tcp)."""
    server, public = {}, None
    if tcp:
        pub_file, secret_file = zmq.auth.create_certificates(workdir, "broker")
        os.chmod(secret_file, 0o600)
        public = zmq.auth.load_certificate(pub_file)[0]
        server = {"curve_secret_key_file": secret_file}
    cfg = {"server": server, "workers": {"devices": ["cpu"], "threads_per_worker": 1},
           "models": [{"name": "double", "versions": [{"version": "1", "path": model}], "max_batch_size": 1,
                       "inputs": [{"name": "x", "dtype": "float32", "shape": [ELEMENTS]}],
                       "outputs": [{"name": "y", "dtype": "float32", "shape": [ELEMENTS]}],
                       "wire_dtypes": ["float16", "bfloat16"]}]}
    b = BrokerProc(cfg, workdir)
    if tcp:
        b.address = f"tcp://127.0.0.1:{free_port()}"
    b.start(wait=False)
    b.wait_for(lambda: Caller(b.address, public).health(), 120, f"ready at {b.address}")
    return b, public


class Caller:
    """One DEALER, as Client.infer uses it (encode, send, wait, decode), counting bytes."""

    def __init__(self, address: str, server_key: bytes | None = None):
        self.address = address
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if server_key is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey = zmq.curve_keypair()
            self.sock.curve_serverkey = server_key
        self.sock.connect(address)
        self.ids = 0

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()

    def health(self) -> bool:
        from tgw.shm.wire import Health
        try:
            self.sock.send(encode_msg(Health(v=PROTOCOL_VERSION, id=0)))
            if not self.sock.poll(1000):
                return False
            return bool(reply_decoder.decode(self.sock.recv_multipart()[0]).ready)
        finally:
            self.close()

    def infer(self, x: np.ndarray, compress, wire_dtype) -> tuple[np.ndarray, int, int]:
        """y, the request's tensor bytes on the wire, the reply's."""
        self.ids += 1
        metas, frames, _, sent = encode({"x": x}, compress, wire_dtype)
        msg = Infer(v=PROTOCOL_VERSION, id=self.ids, model="double", inputs=metas, compress_outputs=compress)
        self.sock.send_multipart([encode_msg(msg), *frames], copy=sent < 65536)
        if not self.sock.poll(60_000):
            raise TimeoutError("no reply within 60 s")
        parts = self.sock.recv_multipart(copy=False)
        reply = reply_decoder.decode(parts[0].buffer)
        if isinstance(reply, ErrorReply):
            raise RuntimeError(f"{reply.error.code}: {reply.error.message}")
        return decode_outputs(reply.outputs, parts[1:])["y"], sent, sum(len(p) for p in parts[1:])


def expected(x: np.ndarray, wire_dtype: str | None) -> np.ndarray:
    if wire_dtype == "float16":
        x = x.astype(np.float16).astype(np.float32)
    elif wire_dtype == "bfloat16":
        x = from_bfloat16_bits(to_bfloat16_bits(x))
    return x * 2


def run_link(link: str, model: str, data: dict, n: int) -> list[dict]:
    workdir = tempfile.mkdtemp(prefix="tgwc-", dir="/tmp")
    b, key = start_broker(workdir, model, tcp=link == "tcp")
    rows = []
    try:
        caller = Caller(b.address, key)
        for kind, x in data.items():
            for label, compress, wire in VARIANTS:
                compress = for_address("auto", b.address) if compress == "link-auto" else compress
                for _ in range(3):   # warm
                    y, up, down = caller.infer(x, compress, wire)
                ok = np.array_equal(y, expected(x, wire))
                times = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    caller.infer(x, compress, wire)
                    times.append(time.perf_counter() - t0)
                times.sort()
                rows.append({"link": link, "data": kind, "variant": label, "up": up, "down": down, "ok": ok,
                             "p50_ms": 1000 * times[len(times) // 2],
                             "p99_ms": 1000 * times[min(len(times) - 1, int(len(times) * 0.99))]})
                print(row_text(rows[-1]), flush=True)
        caller.close()
    finally:
        b.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


HEADER = f"{'link':4} {'data':9} {'variant':24} {'request B':>10} {'reply B':>10} {'wire MiB':>8} " \
         f"{'p50 ms':>7} {'p99 ms':>7}  result"


def row_text(r: dict) -> str:
    return (f"{r['link']:4} {r['data']:9} {r['variant']:24} {r['up']:10d} {r['down']:10d} "
            f"{(r['up'] + r['down']) / MiB:8.2f} {r['p50_ms']:7.2f} {r['p99_ms']:7.2f}  "
            f"{'ok' if r['ok'] else 'MISMATCH'}")


# ---- --rule: lz4 against the link ------------------------------------------------------------------


# ---- --rule: lz4's cost per MiB by compressibility, the links' cost per MiB, the break-even ----

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


# ---- the command ---------------------------------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rule", action="store_true", help="time lz4 and the links (the rule's figures) instead")
    ap.add_argument("-n", type=int, default=60, help="timed requests per row (default 60)")
    ap.add_argument("--links", default="ipc,tcp", help="comma-separated: ipc, tcp (default both)")


def run(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(0)
    if args.rule:
        rule(rng)
        return 0
    d = tempfile.mkdtemp(prefix="tgwm-")
    try:
        model = os.path.join(d, "double.pt")
        build_model(model)
        data = datasets(rng)
        print(f"one caller, one 4 MiB float32 request at a time to y = 2x, {args.n} timed per row")
        print(HEADER, flush=True)
        rows = []
        for link in args.links.split(","):
            rows += run_link(link.strip(), model, data, args.n)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0 if all(r["ok"] for r in rows) else 1
