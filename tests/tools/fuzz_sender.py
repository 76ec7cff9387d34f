"""The fuzzer's sender threads (tests/tools/fuzz.py starts them): one DEALER socket each, a hostile
frame then a `health` sentinel to tell which replies are the frame's, and every --check-every
frames a valid request checked against the model run in this process. Counts go to Tallies."""
from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import lz4.frame
import msgspec
import numpy as np
import zmq

from .fuzz_frames import MODELS, Hostile, enc
from tgw.shm.wire import PROTOCOL_VERSION, DecodeError, ErrorReply, InferReply, reply_decoder

SENTINEL_WAIT_S = 10.0        # a sentinel's reply: past this the socket counts as broken and is replaced
VALID_WAIT_S = 30.0           # a valid request's reply


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
