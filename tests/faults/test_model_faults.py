"""Models misbehaving under load: one that raises on some inputs, one that leaks memory until
its worker is recycled. Requests go out pipelined on raw DEALER sockets, so each reply is
matched to its id: every request must get exactly one answer (no duplicate, no stray, none
missing), with the code its input calls for. Each scenario prints its row of the fault table
(tests/faults/tally.py). Bounded in requests and time; no timing is asserted."""
from __future__ import annotations

import glob
import os
import threading

import numpy as np
import pytest
import zmq

from conftest import EXT, base_config, wait_until
from tally import Tally, row
from tgw.client import Client
from tgw.client.tensors import decode_outputs, encode_inputs
from tgw.shm.errors import error_from_body
from tgw.shm.wire import PROTOCOL_VERSION, ErrorReply, Health, Infer, InferReply, encode, reply_decoder

SENTINEL_ID = 1 << 62
TWO_WORKERS = {"devices": ["cpu", "cpu"], "threads_per_worker": 1, "input_arena_mb": 4, "output_arena_mb": 2}


class Pipelined:
    """`callers` threads, each with its own DEALER keeping `window` requests in flight until
    stop() or `limit` requests each; replies are matched by id. Outcomes go to `tally` and to
    `results` as (inputs, outcome); anything but exactly one reply per request lands in
    `problems`. A socket waits at most `reply_s` for its next reply (then its requests in
    flight count as unanswered), and ends with a health request whose reply must be the last."""

    def __init__(self, address: str, model: str, make_inputs, tally: Tally, callers: int = 4, window: int = 4,
                 limit: int = 100_000, reply_s: float = 30.0):
        self.results: list = []
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        args = (address, model, make_inputs, tally, window, limit, reply_s)
        self.threads = [threading.Thread(target=self._run, args=(i, *args)) for i in range(callers)]
        for t in self.threads:
            t.start()

    def _run(self, i, address, model, make_inputs, tally, window, limit, reply_s) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        inflight: dict[int, dict] = {}
        k = 0
        try:
            while True:
                while len(inflight) < window and k < limit and not self._stop.is_set():
                    k += 1
                    inputs = make_inputs(i, k)
                    metas, frames = encode_inputs(inputs, False)
                    sock.send_multipart([encode(Infer(v=PROTOCOL_VERSION, id=k, model=model, inputs=metas)),
                                         *frames])
                    inflight[k] = inputs
                if not inflight:
                    break
                if not sock.poll(int(reply_s * 1000)):
                    for _ in inflight:
                        tally.add("unanswered")
                    self.problems.append(f"caller {i}: no reply in {reply_s:g} s to ids {sorted(inflight)}")
                    return
                parts = sock.recv_multipart()
                reply = reply_decoder.decode(parts[0])
                if reply.id not in inflight:
                    self.problems.append(f"caller {i}: reply to id {reply.id}, not in flight: {reply!r:.200}")
                    continue
                inputs = inflight.pop(reply.id)
                if isinstance(reply, InferReply):
                    outcome = decode_outputs(reply.outputs, parts[1:])
                elif isinstance(reply, ErrorReply):
                    outcome = error_from_body(reply.error)
                else:
                    self.problems.append(f"caller {i}: unexpected reply {reply!r:.200}")
                    continue
                self.results.append((inputs, tally.add(outcome)))
            sock.send_multipart([encode(Health(v=PROTOCOL_VERSION, id=SENTINEL_ID))])
            while sock.poll(int(reply_s * 1000)):
                reply = reply_decoder.decode(sock.recv_multipart()[0])
                if reply.id == SENTINEL_ID:
                    return
                self.problems.append(f"caller {i}: reply to id {reply.id} after every request was answered")
            self.problems.append(f"caller {i}: no reply to the closing health request")
        finally:
            sock.close()

    def stop(self, now: bool = True) -> list[str]:
        """Stop sending (now, or once each caller sent its `limit`), wait for every answer;
        returns the problems."""
        if now:
            self._stop.set()
        for t in self.threads:
            t.join(180)
            assert not t.is_alive(), "a caller never finished"
        self._ctx.term()
        return self.problems


def test_model_that_raises_under_load(model_files, make_broker):
    """`fails` raises on a negative first element: those requests get MODEL_EXECUTION_ERROR, the
    others their result; one row per batch so the outcome of each request is its own."""
    b = make_broker(base_config(model_files, "fails", workers=TWO_WORKERS, fails={"max_batch_size": 1}))

    def inputs(i: int, k: int) -> dict:
        v = float(i * 10**5 + k)
        return {"x": np.array([[-v if k % 3 == 0 else v, 0.5]], np.float32)}

    t = Tally("model raises on 1/3 of requests, 4x4 pipelined")
    load = Pipelined(b.address, "fails", inputs, t, callers=4, window=4, limit=150)
    problems = load.stop(now=False)
    wrong = []
    for x, out in load.results:
        expect = "MODEL_EXECUTION_ERROR" if x["x"][0, 0] < 0 else "ok"
        got = "ok" if isinstance(out, dict) else out.code.value
        if got != expect or (got == "ok" and not np.array_equal(out["y"], x["x"] + 1)):
            wrong.append((x["x"].tolist(), out))
    with Client(b.address) as c:
        restarts = sum(w["restarts"] for w in c.status()["workers"])
    row(t, f"worker restarts {restarts}")
    assert problems == [] and wrong == []
    assert t.sent == 4 * 150 and t.unanswered == 0
    assert t.counts == {"ok": 400, "MODEL_EXECUTION_ERROR": 200}
    assert restarts == 0  # a model that raises is not a worker that dies
    assert "Traceback" not in b.output()


@pytest.fixture
def leaky_quarter_mib(tmp_path):
    """The test preload's Leaky model, leaking 256 KiB per call (RSS grows, not a GiB a second)."""
    import torch
    import worker_ext  # registers the custom ops in this process, to script the model
    path = str(tmp_path / "leaky.pt")
    torch.jit.script(worker_ext.Leaky(256 << 10)).save(path)
    return {"leaky": (path, worker_ext.IO)}


def test_model_that_leaks_under_load_is_recycled_without_failures(leaky_quarter_mib, make_broker, short_dir):
    snap_dir = os.path.join(short_dir, "snaps")
    leak = {"heartbeat_s": 0.2, "hang_timeout_s": 5.0, "snapshot_dir": snap_dir,
            "leak": {"window_s": 30.0, "min_samples": 5, "mib_per_1k_batches": 50.0, "trace_s": 1.0}}
    b = make_broker(base_config(leaky_quarter_mib, "leaky", supervisor=leak, leaky={"max_batch_size": 4},
                                workers={"devices": ["cpu"], "preload": [EXT], "input_arena_mb": 2,
                                         "output_arena_mb": 2}))
    t = Tally("model leaks 256 KiB/batch, recycled, 4x4 pipelined")
    load = Pipelined(b.address, "leaky", lambda i, k: {"x": np.full((1, 1), i * 10**5 + k, np.float32)}, t,
                     callers=4, window=4)
    try:
        with Client(b.address) as c:
            workers = wait_until(lambda: (ws := c.status()["workers"])
                                 and "worker0[cpu]" not in [w["name"] for w in ws] and ws, 120,
                                 "the leaking worker0 to retire")
    finally:
        problems = load.stop()
    wrong = [(x["x"].tolist(), out) for x, out in load.results
             if not isinstance(out, dict) or not np.array_equal(out["y"], x["x"])]
    row(t, f"snapshots {len(glob.glob(os.path.join(snap_dir, '*.json')))}; now {[w['name'] for w in workers]}")
    assert problems == [] and wrong == []
    assert t.counts == {"ok": t.sent} and t.sent > 0
    assert "retired" in b.output() and "Traceback" not in b.output()
