"""The fuzzer's hostile frames (tests/tools/fuzz.py sends them), one maker per category: random bytes,
broken MessagePack, valid requests with one field or frame wrong, and well-formed requests off
the beaten path. Hostile.make() returns (category, sub-category, frames, the id the broker would
echo or None); the report counts by category, so keep a maker's category name stable."""
from __future__ import annotations

import math
import random
from typing import Any, Callable, Optional

import lz4.frame
import msgspec
import numpy as np

from tgw.shm.wire import PROTOCOL_VERSION

MODELS = ("mlp", "embed")
MAX_REQUEST_BYTES = 4 << 20   # the fuzz broker's server.max_request_bytes: oversize frames stay cheap
enc = msgspec.msgpack.encode


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
