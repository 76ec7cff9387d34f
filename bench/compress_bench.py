"""What lz4 (`compress=True`, `"auto"`) and reduced wire precision (`wire_dtype`) do to one
4 MiB float32 request: bytes on the wire and end-to-end time, over ipc:// and tcp:// (CURVE).

    python -m tgw.bench.compress_bench            # the end-to-end table (ipc and tcp)
    python -m tgw.bench.compress_bench --rule     # the figures behind tgw.shm.compression's rule

The end-to-end rows start a broker (one CPU worker) serving a model built here (`y = 2x`,
x: float32 [1048576], declared with `wire_dtypes: [float16, bfloat16]`), and send it, one at a
time from one caller, a compressible tensor (each value repeated 16 times: lz4 shrinks it to
~12 %) and an incompressible one (normal noise). A request is what Client.infer does: encode
(narrow, compress), send, wait, decode (inflate); its bytes are the request's tensor frames plus
the reply's. "auto" is what a client sends on that link (off over ipc://); "auto, rule forced"
applies the size/ratio rule whatever the link, to show what it would cost there.
`--rule` (compress_rule.py) times lz4 (compress + decompress, per MiB of raw bytes) on tensors of several
compressibilities, and the link (one-way, per MiB: a ROUTER echo over ipc://, tcp:// and tcp://
with CURVE), and prints for each ratio the link cost at which compressing breaks even.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np
import zmq

from tgw.client.tensors import decode_outputs, encode, from_bfloat16_bits, to_bfloat16_bits
from tgw.shm.compression import for_address
from tgw.shm.wire import PROTOCOL_VERSION, ErrorReply, Infer, encode as encode_msg, reply_decoder

from tgw.broker.child import BrokerProc
from tgw.bench.compress_rule import ELEMENTS, MiB, free_port, rule

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

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tgw.bench.compress_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rule", action="store_true", help="time lz4 and the links (the rule's figures) instead")
    ap.add_argument("-n", type=int, default=60, help="timed requests per row (default 60)")
    ap.add_argument("--links", default="ipc,tcp", help="comma-separated: ipc, tcp (default both)")
    args = ap.parse_args(argv)
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


if __name__ == "__main__":
    raise SystemExit(main())
