"""tgw fuzz: hostile frames at a broker of its own, with checked valid requests in between.

    python -m tgw.bench.fuzz [--count 100000] [--threads 4] [--check-every 50] [--seed 1]
    scripts/fuzz.sh [--count N]

Starts a broker (BrokerProc, one CPU worker) serving two of the demo models, built at run time
by `python -m tgw.workers.demo_models` (nothing is downloaded), then sends --count hostile frames from --threads DEALER sockets, one
thread each: random bytes, truncated or garbled MessagePack, valid headers with one field
mutated (wrong types, unknown ops, huge or bool ids, negative or huge shapes, too many dims or
tensors, wrong frame counts or lengths, bad lz4, lz4 declaring 2^48 bytes, headers over the
limit, empty frames...). Every --check-every frames a thread sends a VALID request and compares
its outputs with the same model file run in this process (torch.jit.load).

Which reply belongs to which frame: after each hostile frame the thread sends a `health`
request (the sentinel) and reads until the sentinel's reply. The broker answers a socket's
messages in order unless a request is queued for a worker, so a reply before the sentinel is
the frame's; a frame with none is "deferred", and one whose unique id comes back later is
"late" (it reached a worker). What never comes back by the end (after --drain s) is "no
reply", printed by category: the measured counterpart of docs/PROTOCOL.md's rule on which
frames get none. A frame answered twice, an undecodable reply, a sentinel lost (the socket is
then replaced) are counted as problems.

Prints: frames sent, replies by code, frames without reply by category, valid requests
checked / mismatched / failed, the broker's RSS at start and end, whether it is alive and
serving at the end, the lines of its log containing "Traceback", and every counter its stats
reply carries. Exit status 0; 1 when a valid request failed or mismatched, a frame was
answered twice or undecodably, the broker died or stopped serving, or its log has a traceback;
2 when it could not start. Bounded: every wait has a limit and the run stops after
--max-seconds whatever happens.
"""
from __future__ import annotations

import argparse
import math
import random
import re
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import lz4.frame
import msgspec
import numpy as np
import zmq

from tgw.bench import selfhosted
from tgw.bench.selfhosted import demo_broker
from tgw.shm.wire import PROTOCOL_VERSION, DecodeError, ErrorReply, InferReply, reply_decoder

MODELS = ("mlp", "embed")
MAX_REQUEST_BYTES = 4 << 20   # the fuzz broker's server.max_request_bytes: oversize frames stay cheap
SENTINEL_WAIT_S = 10.0        # a sentinel's reply: past this the socket counts as broken and is replaced
VALID_WAIT_S = 30.0           # a valid request's reply
enc = msgspec.msgpack.encode


# ---- the models -----------------------------------------------------------------------------

def small_limits(cfg: dict) -> None:
    """The fuzz broker's config tweaks: small limits, so oversize frames stay cheap to send."""
    cfg["server"]["max_request_bytes"] = MAX_REQUEST_BYTES
    cfg["workers"].update(input_arena_mb=16, output_arena_mb=8)


class Reference:
    """The served model files, run in this process as a worker runs them, for the expected outputs."""

    def __init__(self, models: dict):
        import torch
        torch.set_num_threads(1)
        self.torch, self.modules = torch, {}
        for name in MODELS:
            m = torch.jit.load(models[name]["path"], map_location="cpu").eval()
            try:
                m = torch.jit.freeze(m)
            except Exception:  # noqa: BLE001 - as the worker: unfrozen when freezing is refused
                pass
            self.modules[name] = m

    def run(self, model: str, inputs: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        torch = self.torch
        with torch.inference_mode():
            out = self.modules[model](*[torch.from_numpy(a.copy()) for a in inputs.values()])
        if isinstance(out, dict):
            return {k: out[k].numpy() for k in names}
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return {k: t.numpy() for k, t in zip(names, outs)}


# ---- hostile frames -------------------------------------------------------------------------

def _mp_str(b: bytes) -> bytes:
    """A MessagePack str of raw bytes (invalid UTF-8 allowed)."""
    n = len(b)
    return (bytes([0xA0 | n]) if n < 32 else b"\xd9" + bytes([n]) if n < 256 else b"\xda" + n.to_bytes(2, "big")) + b


def _xxh32_short(data: bytes, seed: int = 0) -> int:
    """xxHash32 of fewer than 16 bytes (an lz4 frame descriptor's checksum)."""
    p1, p2, p3, p4, p5, m = 2654435761, 2246822519, 3266489917, 668265263, 374761393, 0xFFFFFFFF
    rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & m  # noqa: E731
    assert len(data) < 16
    h, i = (seed + p5 + len(data)) & m, 0
    while i + 4 <= len(data):
        h = rotl((h + int.from_bytes(data[i:i + 4], "little") * p3) & m, 17) * p4 & m
        i += 4
    for b in data[i:]:
        h = rotl((h + b * p5) & m, 11) * p1 & m
    h = ((h ^ (h >> 15)) * p2) & m
    h = ((h ^ (h >> 13)) * p3) & m
    return h ^ (h >> 16)


def _lz4_declaring(size: int, payload: bytes) -> bytes:
    """An lz4 frame whose header declares `size` content bytes (checksum valid), holding `payload`."""
    z = bytearray(lz4.frame.compress(payload, store_size=True))
    assert z[4] & 0x08 and not z[4] & 0x01  # content size present, no dictionary id: it sits at [6:14]
    z[6:14] = size.to_bytes(8, "little")
    z[14] = (_xxh32_short(bytes(z[4:14])) >> 8) & 0xFF
    return bytes(z)


class Hostile:
    """One thread's frame maker: make() -> (category, sub, frames, id the broker would echo or None)."""

    def __init__(self, rng: random.Random, next_id: Callable[[], int], only: Optional[list[str]] = None):
        self.r, self.next_id = rng, next_id
        gens = [(self.random_bytes, 6), (self.empty, 4), (self.truncated, 6), (self.garbled, 6), (self.not_a_map, 4),
                (self.deep_nesting, 1), (self.raw_maps, 3), (self.unknown_op, 4), (self.version, 3),
                (self.id_types, 4), (self.huge_ids, 3), (self.field_types, 12), (self.shapes, 10),
                (self.dtypes, 4), (self.tensor_counts, 4), (self.frame_counts, 4), (self.frame_lengths, 4),
                (self.lz4, 8), (self.huge_header, 1), (self.oversize_frame, 0.05), (self.other_ops, 5),
                (self.strings, 3), (self.valid_variants, 3)]
        gens = [(g, w) for g, w in gens if not only or g.__name__ in only]
        self.gens, self.weights = [g for g, _ in gens], [w for _, w in gens]

    @classmethod
    def kinds(cls) -> list[str]:
        """The generators' names, for --only (a category's name in the report may differ)."""
        return [n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")
                and n not in ("make", "infer", "kinds")]

    def make(self):
        return self.r.choices(self.gens, self.weights)[0]()

    # templates
    def infer(self, model: Optional[str] = None, rid: Optional[int] = None):
        """A valid infer header (dict) and its frames."""
        r = self.r
        model = model or r.choice(MODELS)
        b = r.randint(1, 4)
        if model == "mlp":
            metas, frames = [{"name": "x", "dtype": "float32", "shape": [b, 256]}], [r.randbytes(b * 1024)]
        else:
            t = r.randint(1, 12)
            metas = [{"name": "tokens", "dtype": "int64", "shape": [b, t]}]
            frames = [np.array([r.randrange(1000) for _ in range(b * t)], np.int64).tobytes()]
        return {"op": "infer", "v": PROTOCOL_VERSION, "id": self.next_id() if rid is None else rid, "model": model,
                "inputs": metas}, frames

    def _send_infer(self, cat: str, sub: str, h: dict, frames: list, echo: bool = True):
        return cat, sub, [enc(h), *frames], h["id"] if echo and type(h.get("id")) is int else None

    # categories
    def random_bytes(self):
        r = self.r
        head = r.randbytes(r.choice([1, 2, 8, 64, 256]))
        return "random_bytes", "random", [head, *[r.randbytes(r.randint(0, 64)) for _ in range(r.randint(0, 2))]], None

    def empty(self):
        r = self.r
        kind = r.choice(["header only", "header + frames", "infer + empty frame", "empty inputs",
                         "empty map", "empty map + frames"])
        if kind == "header only":
            return "empty", kind, [b""], None
        if kind == "header + frames":
            return "empty", kind, [b"", *[r.randbytes(r.randint(0, 8)) for _ in range(r.randint(1, 3))]], None
        if kind == "infer + empty frame":
            h, _ = self.infer()
            return self._send_infer("empty", kind, h, [b""])
        if kind == "empty inputs":
            h, _ = self.infer()
            h["inputs"] = []
            return self._send_infer("empty", kind, h, [])
        return "empty", kind, [enc({}), *([b""] if kind.endswith("frames") else [])], None

    def truncated(self):
        h, frames = self.infer()
        data = enc(h)
        return "truncated_msgpack", "cut", [data[:self.r.randrange(1, len(data))], *frames], None

    def garbled(self):
        r = self.r
        h, frames = self.infer()
        data = bytearray(enc(h))
        for _ in range(r.randint(1, 4)):
            data[r.randrange(len(data))] = r.randrange(256)
        return "garbled_msgpack", "flipped bytes", [bytes(data), *frames], None

    def not_a_map(self):
        r = self.r
        v = r.choice([None, True, 0, -1, 2**64 - 1, 1.5, "infer", b"\x00\x01", [], [1, "op", "infer"],
                      ["infer", 1, 1, "mlp", []], msgspec.msgpack.Ext(1, b"x"), float("nan")])
        return "not_a_map", type(v).__name__, [enc(v)], None

    def deep_nesting(self):
        r = self.r
        depth = r.choice([100, 1000, 10_000, 60_000])
        where = r.choice(["top-level array", "model", "extra field", "id", "v"])
        if where == "top-level array":
            return "deep_nesting", f"{where} depth {depth}", [b"\x91" * depth + b"\xc0"], None
        fields = {"op": _mp_str(b"health"), "v": b"\x01", "id": enc(self.next_id())}
        fields[where if where != "extra field" else "extra"] = b"\x81\xa1a" * depth + b"\xc0"  # {"a": {"a": ...}}
        head = bytes([0x80 | len(fields)]) + b"".join(_mp_str(k.encode()) + v for k, v in fields.items())
        return "deep_nesting", f"map in {where}, depth {depth}", [head], None

    def raw_maps(self):
        r = self.r
        kind = r.choice(["int keys", "bin keys", "duplicate keys", "ext values", "invalid utf-8 key",
                         "map16 claims more"])
        if kind == "int keys":
            return "raw_maps", kind, [enc({1: "infer", 2: 1, 3: self.next_id()})], None
        if kind == "bin keys":
            return "raw_maps", kind, [b"\x83\xc4\x02op\xa5hello\xc4\x01v\x01\xc4\x02id\x05"], None
        if kind == "duplicate keys":
            rid = self.next_id()
            head = b"\x84" + _mp_str(b"op") + _mp_str(b"infer") + _mp_str(b"op") + _mp_str(b"health") \
                + _mp_str(b"v") + b"\x01" + _mp_str(b"id") + enc(rid)
            return "raw_maps", kind, [head], rid
        if kind == "ext values":
            h = {"op": "health", "v": msgspec.msgpack.Ext(r.randrange(-128, 128), b"\x01\x02"), "id": self.next_id()}
            return "raw_maps", kind, [enc(h)], h["id"]
        if kind == "invalid utf-8 key":
            return "raw_maps", kind, [b"\x83" + _mp_str(b"\xff\xfe") + _mp_str(b"hello") + _mp_str(b"v") + b"\x01"
                                      + _mp_str(b"id") + b"\x05"], None
        return "raw_maps", kind, [b"\xde\xff\xff" + _mp_str(b"op") + _mp_str(b"hello")], None

    def unknown_op(self):
        r = self.r
        h = {"v": PROTOCOL_VERSION, "id": self.next_id()}
        kind = r.choice(["unknown name", "missing", "int", "bin", "nil", "w_ internal op", "reply op"])
        op = {"unknown name": "frobnicate", "int": 7, "bin": b"infer", "nil": None, "w_ internal op": "w_stop",
              "reply op": "error"}.get(kind)
        if kind != "missing":
            h["op"] = op
        return "unknown_op", kind, [enc(h)], h["id"]

    def version(self):
        v = self.r.choice([0, 2, -1, 2**64 - 1, -2**63, "1", 1.0, True, None, [1]])
        h, frames = self.infer() if self.r.random() < 0.5 else ({"op": "health", "id": self.next_id()}, [])
        h["v"] = v
        return "version", repr(v)[:12], [enc(h), *frames], h["id"]

    def id_types(self):
        r = self.r
        v = r.choice([True, False, 1.5, "7", None, b"\x07", [1], {"a": 1}, float("inf")])
        h, frames = self.infer() if r.random() < 0.5 else ({"op": r.choice(["health", "hello", "models"]),
                                                             "v": PROTOCOL_VERSION}, [])
        h["id"] = v
        return "id_types", type(v).__name__, [enc(h), *frames], None

    def huge_ids(self):
        """Ids at the edges of MessagePack's integer range, unique per thread so late replies match."""
        r = self.r
        n = self.next_id() & 0xFFFFFFFF
        rid = r.choice([2**64 - 1 - n, -2**63 + n, 2**63 - 1 - n, -1 - n])
        h, frames = self.infer(rid=rid) if r.random() < 0.7 else ({"op": "health", "v": PROTOCOL_VERSION,
                                                                  "id": rid}, [])
        return self._send_infer("huge_ids", "negative" if rid < 0 else "huge", h, frames)

    def field_types(self):
        r = self.r
        h, frames = self.infer()
        fld, v = r.choice([
            ("model", 7), ("model", None), ("model", b"mlp"), ("model", ["mlp"]),
            ("inputs", {"x": 1}), ("inputs", "x"), ("inputs", [1, 2]), ("inputs", [{"name": "x"}]),
            ("inputs", None), ("timeout_ms", 1.5), ("timeout_ms", "10"), ("timeout_ms", -1), ("timeout_ms", 2**63),
            ("timeout_ms", 2**64 - 1), ("timeout_ms", 0), ("priority", "high"), ("priority", 2**64 - 1),
            ("priority", -2**63), ("compress_outputs", 1), ("compress_outputs", "yes"), ("outputs", "y"),
            ("outputs", [1]), ("outputs", ["y", "y"]), ("outputs", ["nope"]), ("outputs", []), ("version", 1),
            ("version", ""), ("version", "9"), ("version", "x" * 1000), ("token", 1), ("token", "t" * 10_000),
            ("extra", {"deep": [1, {"x": None}]}), ("v", 1.0)])
        h[fld] = v
        return self._send_infer("field_types", f"{fld}={repr(v)[:16]}", h, frames)

    def shapes(self):
        r = self.r
        h, frames = self.infer("mlp")
        shape = r.choice([[-1, 256], [0, 256], [2**62, 256], [2**32, 2**32], [1] + [1] * 1000, [1] * 20, [],
                          [1, 256, 1], [65, 256], [1, -256], [2**63 - 1, 2**63 - 1], [2**64 - 1, 1], [1.0, 256],
                          [True, 256], ["1", 256], [None], [1, 2**31], [-2**63, 256], [1, 255], [1, 257]])
        h["inputs"][0]["shape"] = shape
        n = 4 * math.prod(shape) if all(type(d) is int for d in shape) else -1
        frame = r.randbytes(n) if 0 <= n <= 256 * 1024 else r.randbytes(r.choice([0, 4, 1024]))
        if r.random() < 0.3:  # embed: variable dims
            h, _ = self.infer("embed")
            h["inputs"][0]["shape"] = r.choice([[1, 2**40], [1, 0], [0, 5], [33, 1], [1, -1], [1, 2**20],
                                                [1, 2**19], [1, 1, 1]])
            frame = r.randbytes(r.choice([0, 8, 64]))
        return self._send_infer("shapes", repr(shape)[:24], h, [frame])

    def dtypes(self):
        h, frames = self.infer("mlp")
        d = self.r.choice(["complex64", "", "float32\x00", "x" * 10_000, "bfloat16", "float", "<f4", "FLOAT32",
                           "int32", "float64", "object", "bool"])
        h["inputs"][0]["dtype"] = d
        return self._send_infer("dtypes", repr(d)[:16], h, frames)

    def tensor_counts(self):
        r = self.r
        n = r.choice([2, 16, 65, 1000, 5000])
        h, frames = self.infer("mlp")
        h["inputs"] = [dict(h["inputs"][0], name=r.choice(["x", f"x{i}"])) for i in range(n)]
        nframes = r.choice([n, 1, min(n, 64)])
        return self._send_infer("tensor_counts", f"{n} inputs, {nframes} frames", h, [frames[0]] * nframes)

    def frame_counts(self):
        n = self.r.choice([0, 2, 3, 64, 65, 100])
        h, frames = self.infer()
        return self._send_infer("frame_counts", f"{n} frames for 1 input", h, (frames * n)[:n])

    def frame_lengths(self):
        r = self.r
        h, frames = self.infer()
        d = r.choice([-1, 1, -8, 8])
        f = frames[0]
        frame = f[:d] if d < 0 else f + r.randbytes(d)
        return self._send_infer("frame_lengths", f"{d:+d} bytes", h, [frame])

    def lz4(self):
        r = self.r
        h, frames = self.infer("mlp")
        raw = frames[0]
        kind = r.choice(["random bytes", "truncated", "too short", "too long", "declares 2^48", "declares 2^48 small",
                         "inflates past declared", "wrong codec name", "compression int", "empty frame"])
        comp = "lz4"
        if kind == "random bytes":
            frame = r.randbytes(r.randint(1, 64))
        elif kind == "truncated":
            z = lz4.frame.compress(raw)
            frame = z[:r.randrange(1, len(z))]
        elif kind == "too short":
            frame = lz4.frame.compress(raw[:-4])
        elif kind == "too long":
            frame = lz4.frame.compress(raw + b"\0" * 4)
        elif kind == "declares 2^48":
            frame = _lz4_declaring(2**48, raw)
        elif kind == "declares 2^48 small":
            frame = _lz4_declaring(2**48, b"\0" * 16)
        elif kind == "inflates past declared":
            frame = lz4.frame.compress(b"\0" * (r.choice([1, 16]) << 20))  # 1 or 16 MiB of zeros for n bytes
        elif kind == "wrong codec name":
            comp, frame = r.choice(["zstd", "LZ4", "lz4 ", "", "gzip"]), lz4.frame.compress(raw)
        elif kind == "compression int":
            comp, frame = 1, raw
        else:
            frame = b""
        h["inputs"][0]["compression"] = comp
        return self._send_infer("lz4", kind, h, [frame])

    def huge_header(self):
        r = self.r
        size = r.choice([(64 << 10) - 200, (64 << 10) + 1, 256 << 10, 1 << 20])
        h, frames = self.infer()
        h["pad"] = "x" * size
        return self._send_infer("huge_header", f"{size >> 10} KiB", h, frames)

    def oversize_frame(self):
        """A tensor frame over max_request_bytes (which the broker also sets as ZMQ_MAXMSGSIZE)."""
        h, _ = self.infer("mlp")
        rows = MAX_REQUEST_BYTES // 1024 + 1
        h["inputs"][0]["shape"] = [rows, 256]
        return self._send_infer("oversize_frame", f"{rows} KiB frame", h, [bytes(rows * 1024)])

    def other_ops(self):
        r = self.r
        op = r.choice(["hello", "models", "health", "stats", "status", "snapshot"])
        h: dict[str, Any] = {"op": op, "v": PROTOCOL_VERSION, "id": self.next_id()}
        if op == "snapshot":  # never a live worker's index: a real snapshot starts tracemalloc in it
            h["worker"] = r.choice([1, 7, -1, 2**63 - 1, 2**64 - 1, True, "0", 1.5])
            sub = f"snapshot worker={h['worker']!r}"[:28]
        else:
            fld, v = r.choice([("client", 7), ("client", "c" * 5000), ("token", b"x"), ("extra", [None] * 100),
                               ("inputs", "x"), ("model", 1), (None, None)])
            if fld:
                h[fld] = v
            sub = f"{op} {fld}={repr(v)[:10]}"
        frames = [r.randbytes(r.randint(0, 16)) for _ in range(r.choice([0, 0, 1, 2]))]
        return "other_ops", sub, [enc(h), *frames], h["id"]

    def strings(self):
        r = self.r
        h, frames = self.infer("mlp")
        kind = r.choice(["model unicode", "model 10k", "model path", "model nul", "input name", "invalid utf-8"])
        if kind == "invalid utf-8":
            head = b"\x85" + _mp_str(b"op") + _mp_str(b"infer") + _mp_str(b"v") + b"\x01" + _mp_str(b"id") \
                + enc(h["id"]) + _mp_str(b"model") + _mp_str(b"ml\xff\xfe") + _mp_str(b"inputs") + enc(h["inputs"])
            return "strings", kind, [head, *frames], h["id"]
        if kind == "input name":
            h["inputs"][0]["name"] = r.choice(["", "x\x00", "y", "X", "\u00e9" * 100])
        else:
            h["model"] = {"model unicode": "m\u00f6del\U0001F600", "model 10k": "m" * 10_000,
                          "model path": "../../etc/passwd", "model nul": "mlp\x00"}[kind]
        return self._send_infer("strings", kind, h, frames)

    def valid_variants(self):
        """Well-formed requests off the beaten path (answered normally or with a documented error)."""
        r = self.r
        h, frames = self.infer()
        kind = r.choice(["timeout_ms 0", "compress_outputs", "outputs subset", "version 1", "max batch", "lz4"])
        if kind == "timeout_ms 0":
            h["timeout_ms"] = 0
        elif kind == "compress_outputs":
            h["compress_outputs"] = True
        elif kind == "outputs subset":
            h["outputs"] = ["y"] if h["model"] == "mlp" else ["length"]
        elif kind == "version 1":
            h["version"] = "1"
        elif kind == "max batch":
            h, _ = self.infer("mlp")
            h["inputs"][0]["shape"] = [64, 256]
            frames = [r.randbytes(64 * 1024)]
        else:
            h["inputs"][0]["compression"] = "lz4"
            frames = [lz4.frame.compress(frames[0])]
        return self._send_infer("valid_variants", kind, h, frames)


# ---- the senders ----------------------------------------------------------------------------

@dataclass
class Tallies:
    sent: Counter = field(default_factory=Counter)                  # category -> frames
    codes: dict = field(default_factory=lambda: defaultdict(Counter))  # category -> reply code -> n
    no_reply: Counter = field(default_factory=Counter)              # "category: sub" -> frames never answered
    late: Counter = field(default_factory=Counter)                  # category -> answered after the sentinel
    twice: Counter = field(default_factory=Counter)                 # "category: sub" -> answered more than once
    unattributed: Counter = field(default_factory=Counter)          # replies matching no frame, by code
    problems: list = field(default_factory=list)
    checked: int = 0
    mismatched: int = 0
    failed: int = 0
    sockets_replaced: int = 0

    def merge(self, o: "Tallies") -> None:
        self.sent += o.sent
        for k, c in o.codes.items():
            self.codes[k] += c
        self.no_reply += o.no_reply
        self.late += o.late
        self.twice += o.twice
        self.unattributed += o.unattributed
        self.problems += o.problems
        self.checked += o.checked
        self.mismatched += o.mismatched
        self.failed += o.failed
        self.sockets_replaced += o.sockets_replaced


def reply_code(reply) -> str:
    return reply.error.code if isinstance(reply, ErrorReply) else reply.op if hasattr(reply, "op") else \
        type(reply).__name__


class Sender(threading.Thread):
    def __init__(self, index: int, address: str, count: int, args, ref: Reference, models: dict, deadline: float):
        super().__init__(name=f"fuzz-{index}", daemon=True)
        self.index, self.address, self.count, self.args = index, address, count, args
        self.ref, self.models, self.deadline = ref, models, deadline
        self.t = Tallies()
        self.rng = random.Random(args.seed * 1000 + index)
        self._ids = iter(range((index + 1) << 40, (index + 2) << 40))
        self.pending: dict[int, str] = {}  # deferred frames' ids -> "category: sub"
        self.ctx = zmq.Context()
        self.sock = self._connect()
        self.done = 0

    def next_id(self) -> int:
        return next(self._ids)

    def _connect(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.address)
        return s

    def _replace_socket(self, why: str) -> None:
        self.t.problems.append(f"{self.name}: {why}; socket replaced, {len(self.pending)} deferred frame(s) lost")
        for what in self.pending.values():
            self.t.no_reply[what] += 1
        self.pending.clear()
        self.sock.close(0)
        self.sock = self._connect()
        self.t.sockets_replaced += 1

    def _recv(self, wait_s: float):
        """The next reply (decoded, parts) or None after wait_s; undecodable replies are problems."""
        end = time.monotonic() + wait_s
        while True:
            if not self.sock.poll(max(0, int((end - time.monotonic()) * 1000))):
                return None
            parts = self.sock.recv_multipart()
            try:
                reply = reply_decoder.decode(parts[0])
            except DecodeError as exc:
                self.t.problems.append(f"{self.name}: undecodable reply {parts[0][:80]!r}: {exc}")
                continue
            frames = len(reply.outputs) if isinstance(reply, InferReply) else 0
            if len(parts) - 1 != frames:
                self.t.problems.append(f"{self.name}: {reply_code(reply)} reply with {len(parts) - 1} tensor frames, "
                                       f"expected {frames}")
            return reply, parts

    def _until(self, rid: int, wait_s: float):
        """Read until the reply with id `rid`; returns (replies before it that answer no deferred
        frame, its parts or None). Replies to deferred frames are counted as late."""
        others = []
        end = time.monotonic() + wait_s
        while True:
            got = self._recv(end - time.monotonic())
            if got is None:
                return others, None
            reply, parts = got
            if reply.id == rid:
                return others, parts
            if reply.id in self.pending:
                what = self.pending.pop(reply.id)
                self.t.late[what.split(":")[0]] += 1
                self.t.codes[what.split(":")[0]][reply_code(reply)] += 1
            else:
                others.append(reply)

    def hostile(self, gen: Hostile) -> None:
        cat, sub, frames, echo = gen.make()
        if echo is None:  # a garbled header may still decode, even as a valid request: with which id?
            try:
                head = msgspec.msgpack.decode(frames[0])
                echo = head["id"] if isinstance(head, dict) and type(head.get("id")) is int else None
            except Exception:  # noqa: BLE001 - undecodable (or too deep) here too: no id to expect
                pass
        what = f"{cat}: {sub}"
        self.t.sent[cat] += 1
        self.sock.send_multipart(frames)
        sid = self.next_id()
        self.sock.send_multipart([enc({"op": "health", "v": PROTOCOL_VERSION, "id": sid})])
        answers, sentinel = self._until(sid, SENTINEL_WAIT_S)
        for reply in answers:
            self.t.codes[cat][reply_code(reply)] += 1
        if len(answers) > 1:
            self.t.twice[what] += 1
        if sentinel is None:
            if not answers:
                self.t.no_reply[what] += 1
            self._replace_socket(f"no reply to the sentinel after {what}")
        elif not answers:
            if echo is not None and echo not in self.pending:
                self.pending[echo] = what  # may be queued for a worker: its reply comes later
            else:
                self.t.no_reply[what] += 1

    def valid(self) -> None:
        r = self.rng
        model = r.choice(MODELS)
        b = r.randint(1, 4)
        if model == "mlp":
            inputs = {"x": np.array([r.gauss(0, 1) for _ in range(b * 256)], np.float32).reshape(b, 256)}
        else:
            inputs = {"tokens": np.array([r.randrange(10**6) for _ in range(b * r.randint(1, 16))],
                                         np.int64).reshape(b, -1)}
        compress = r.random() < 0.2
        names = [o["name"] for o in self.models[model]["outputs"]]
        rid = self.next_id()
        metas = [{"name": k, "dtype": a.dtype.name, "shape": list(a.shape), **({"compression": "lz4"} if compress
                                                                                 else {})} for k, a in inputs.items()]
        frames = [lz4.frame.compress(a.tobytes()) if compress else a.tobytes() for a in inputs.values()]
        self.sock.send_multipart([enc({"op": "infer", "v": PROTOCOL_VERSION, "id": rid, "model": model,
                                       "inputs": metas, "compress_outputs": compress}), *frames])
        others, parts = self._until(rid, VALID_WAIT_S)
        for reply in others:
            self.t.unattributed[reply_code(reply)] += 1
        self.t.checked += 1
        if parts is None:
            self.t.failed += 1
            self.t.problems.append(f"{self.name}: valid {model} request {rid}: no reply in {VALID_WAIT_S:g} s")
            self._replace_socket("a valid request went unanswered")
            return
        reply = reply_decoder.decode(parts[0])
        if not isinstance(reply, InferReply):
            self.t.failed += 1
            self.t.problems.append(f"{self.name}: valid {model} request {rid}: {reply_code(reply)} "
                                   f"{getattr(getattr(reply, 'error', None), 'message', '')[:200]}")
            return
        from tgw.client.tensors import decode_outputs
        got = decode_outputs(reply.outputs, parts[1:])
        want = self.ref.run(model, inputs, names)
        bad = [k for k in names if k not in got or got[k].shape != want[k].shape
               or not np.allclose(got[k], want[k], rtol=1e-4, atol=1e-5)]
        if bad:
            self.t.mismatched += 1
            self.t.problems.append(f"{self.name}: valid {model} request {rid}: outputs {bad} differ from the model "
                                   "run in-process")

    def run(self) -> None:
        gen = Hostile(self.rng, self.next_id, self.args.only)
        try:
            self.valid()
            while self.done < self.count and time.monotonic() < self.deadline:
                self.hostile(gen)
                self.done += 1
                if self.done % self.args.check_every == 0:
                    self.valid()
            self.valid()
        except Exception as exc:  # noqa: BLE001 - a harness bug is reported, not hidden
            import traceback
            self.t.problems.append(f"{self.name}: harness error: {exc!r}\n{traceback.format_exc()}")

    def drain(self, wait_s: float) -> None:
        """Wait (bounded) for the deferred frames' replies; what is left got none."""
        end = time.monotonic() + wait_s
        while self.pending and time.monotonic() < end:
            got = self._recv(end - time.monotonic())
            if got is None:
                break
            reply, _ = got
            what = self.pending.pop(reply.id, None)
            if what is None:
                self.t.unattributed[reply_code(reply)] += 1
            else:
                self.t.late[what.split(":")[0]] += 1
                self.t.codes[what.split(":")[0]][reply_code(reply)] += 1
        for what in self.pending.values():
            self.t.no_reply[what] += 1
        self.pending.clear()
        self.sock.close(0)
        self.ctx.term()


# ---- the run --------------------------------------------------------------------------------

def rss_mb(pid: Optional[int]) -> Optional[float]:
    import psutil
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except (psutil.Error, TypeError):
        return None


def raw_stats(address: str) -> dict:
    """The broker's stats reply as it comes (untyped), so new counters show without code changes here."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    try:
        s.send(enc({"op": "stats", "v": PROTOCOL_VERSION, "id": 1}))
        return msgspec.msgpack.decode(s.recv()) if s.poll(10_000) else {}
    finally:
        s.close(0)
        ctx.term()


def serving(address: str, ref: Reference) -> tuple[bool, str]:
    """Whether the broker answers health as ready and computes a valid request correctly."""
    from tgw.client import Client
    try:
        with Client(address, connect_timeout=5.0) as c:
            if not c.health()["ready"]:
                return False, "health: not ready"
            x = {"x": np.linspace(-1, 1, 256, dtype=np.float32).reshape(1, 256)}
            got = c.infer("mlp", x, timeout=30.0)["y"]
            ok = np.allclose(got, ref.run("mlp", x, ["y"])["y"], rtol=1e-4, atol=1e-5)
            return ok, "ready, computes correctly" if ok else "ready, but a valid request came back wrong"
    except Exception as exc:  # noqa: BLE001 - any failure here is the answer
        return False, f"{type(exc).__name__}: {exc}"


def last_exceptions(log: str) -> list[str]:
    """The exception line that ends each traceback in a log (not the causes of chained ones)."""
    lines = log.splitlines()
    out = []
    for i, line in enumerate(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", line):
            after = " ".join(lines[i + 1:i + 3])
            if "During handling of the above" not in after and "The above exception was" not in after:
                out.append(line)
    return out


def report(t: Tallies, n: int, elapsed: float, threads: int) -> list[str]:
    lines = [f"frames sent: {n} hostile from {threads} sockets in {elapsed:.1f} s ({n / max(elapsed, 1e-9):.0f}/s), "
             f"plus {t.checked} checked valid requests"]
    total = Counter()
    for c in t.codes.values():
        total += c
    lines.append("replies by code: " + ", ".join(f"{k} {v}" for k, v in total.most_common()))
    lines.append(f"{'category':<18} {'sent':>7} {'replied':>7} {'late':>5} {'none':>6}  codes")
    for cat in sorted(t.sent):
        none = sum(v for k, v in t.no_reply.items() if k.split(":")[0] == cat)
        codes = ", ".join(f"{k} {v}" for k, v in t.codes[cat].most_common(4))
        lines.append(f"{cat:<18} {t.sent[cat]:>7} {sum(t.codes[cat].values()):>7} {t.late[cat]:>5} {none:>6}  {codes}")
    lines.append(f"frames with no reply: {sum(t.no_reply.values())}" + ("" if not t.no_reply else " - by category:"))
    lines += [f"  {v:>6}  {k}" for k, v in sorted(t.no_reply.items())]
    if t.twice:
        lines.append("frames answered more than once: " + ", ".join(f"{k} x{v}" for k, v in t.twice.items()))
    if t.unattributed:
        lines.append("replies matching no frame: " + ", ".join(f"{k} {v}" for k, v in t.unattributed.items()))
    if t.sockets_replaced:
        lines.append(f"sockets replaced after a lost sentinel: {t.sockets_replaced}")
    lines.append(f"valid requests: {t.checked} checked, {t.mismatched} mismatched, {t.failed} failed")
    return lines


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = selfhosted.parser("python -m tgw.bench.fuzz", __doc__)
    ap.add_argument("--count", type=int, default=100_000, help="hostile frames in all (default 100000)")
    ap.add_argument("--threads", type=int, default=4, help="sender threads, one DEALER socket each (default 4)")
    ap.add_argument("--check-every", type=int, default=50, help="a checked valid request every N frames per thread")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--drain", type=float, default=5.0, help="seconds to wait at the end for deferred replies")
    ap.add_argument("--max-seconds", type=float, default=900.0, help="stop sending after this long (default 900)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (models, config, broker log)")
    ap.add_argument("--only", type=lambda t: [x for x in t.split(",") if x],
                    help=f"only these frame makers, comma-separated: {','.join(Hostile.kinds())}")
    a = ap.parse_args(argv)
    if a.only and set(a.only) - set(Hostile.kinds()):
        ap.error(f"--only: choose from {','.join(Hostile.kinds())}")
    if a.count < 0 or a.threads < 1 or a.check_every < 1:
        ap.error("--count >= 0, --threads >= 1, --check-every >= 1")
    return a


def run(argv: Optional[list[str]] = None, out: Callable[[str], None] = print) -> tuple[int, dict]:
    """The whole run; returns (exit status, summary). `out` receives the report's lines."""
    a = parse(argv)
    with demo_broker(list(MODELS), 1, tweak=small_limits, keep=a.keep, out=out) as (broker, models):
        return fuzz(a, broker, models, out)


def fuzz(a: argparse.Namespace, broker, models: dict, out: Callable[[str], None]) -> tuple[int, dict]:
    ref = Reference(models)
    rss0 = rss_mb(broker.pid)
    t0 = time.monotonic()
    deadline = t0 + a.max_seconds
    shares = [a.count // a.threads + (1 if i < a.count % a.threads else 0) for i in range(a.threads)]
    senders = [Sender(i, broker.address, shares[i], a, ref, models, deadline) for i in range(a.threads)]
    for s in senders:
        s.start()
    for s in senders:
        s.join(a.max_seconds + 2 * VALID_WAIT_S + 60)
    elapsed = time.monotonic() - t0
    t = Tallies()
    for s in senders:
        if s.is_alive():
            t.problems.append(f"{s.name} still running past --max-seconds")
            continue
        s.drain(a.drain)
        t.merge(s.t)
    sent = sum(s.done for s in senders)
    for line in report(t, sent, elapsed, a.threads):
        out(line)
    alive = broker.alive()
    ok_serving, how = serving(broker.address, ref) if alive else (False, "broker not running")
    stats = raw_stats(broker.address) if alive else {}
    rss1 = rss_mb(broker.pid)
    code = broker.stop()  # its shutdown is part of the test: a traceback then counts too
    log = broker.output()
    tracebacks = sum("Traceback" in line for line in log.splitlines())
    out(f"broker RSS: {rss0:.1f} MiB at start, {rss1 or 0:.1f} MiB at end" if rss0 else "broker RSS: unknown")
    out(f"broker alive at the end: {alive}; serving: {ok_serving} ({how}); exit status on SIGTERM: {code}")
    out(f"broker log lines with 'Traceback': {tracebacks}")
    for k, v in stats.items():
        if k in ("op", "v", "id", "processes"):
            continue
        if k == "models":
            v = {m: {kk: vv for kk, vv in d.items() if kk in ("requests", "replies", "errors")} for m, d in v.items()}
        out(f"broker stats {k}: {v}")
    for p in t.problems[:20]:
        out(f"problem: {p}")
    if len(t.problems) > 20:
        out(f"problem: ... and {len(t.problems) - 20} more")
    failed = (t.mismatched or t.failed or not alive or not ok_serving or code != 0 or tracebacks or t.twice
              or any("undecodable" in p or "harness error" in p or "still running" in p for p in t.problems)
              or sent < a.count)
    summary = {"sent": sent, "checked": t.checked, "mismatched": t.mismatched, "failed": t.failed,
               "no_reply": dict(t.no_reply), "twice": dict(t.twice), "late": dict(t.late), "alive": alive,
               "serving": ok_serving, "exit_status": code, "tracebacks": tracebacks, "rss_mb": (rss0, rss1),
               "problems": t.problems, "stats": stats}
    if tracebacks:
        ends = Counter(last_exceptions(log))
        out("exceptions ending the tracebacks: " + "; ".join(f"{k[:160]} x{v}" for k, v in ends.most_common(8)))
        first = log.index("Traceback")
        start = log.rfind("\n", 0, log.rfind("\n", 0, first)) + 1  # from the log line before it
        out("first traceback in the broker log:\n" + log[start:start + 2500])
    out("fuzz: " + ("FAIL" if failed else "PASS"))
    return (1 if failed else 0), summary


def main(argv: Optional[list[str]] = None) -> int:
    return selfhosted.main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
