"""bytes and bfloat16 tensors through the broker's checks (sched/limits.py, sched/inbound.py,
models/checks.py, sched/admission.py), arena sizing (config/arenas.py), staging and reply slicing
(state/pool.py): a real Config with stages, registry, batcher and a real segment; no processes."""
from __future__ import annotations

import lz4.frame
import numpy as np
import pytest

from conftest import unloaded_model
from rigs import tenants_of
from tgw.broker.config.arenas import VARIABLE_OUTPUT_BYTES, input_need, output_need
from tgw.broker.config.load import parse_config
from tgw.broker.models.entry import ModelEntry
from tgw.broker.models.registry import Registry
from tgw.broker.sched.admission import Admission, Owed
from tgw.broker.sched.batcher import Batcher
from tgw.broker.state.pool import WorkerHandle
from tgw.broker.state.stats import Stats
from tgw.shm.bytes_tensor import pack, unpack
from tgw.shm.ring import align_up
from tgw.shm.segment import Segment, new_name
from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import PROTOCOL_VERSION, BlockTensor, Done, Infer, RegionSlice, TensorMeta

HANDLER = "tgw.workers.stage:Stage"   # module:Class: the schema needs no file for it
MAX_REQUEST = 4096
MAX_ELEMENT = 100


def stage(name: str, inputs: list, outputs: list) -> dict:
    return {"name": name, "versions": [{"version": "1", "handler": HANDLER}], "inputs": inputs, "outputs": outputs,
            "max_batch_size": 64}


BYTES = {"name": "data", "dtype": "bytes", "shape": []}
STAGES = [stage("echo", [BYTES], [BYTES]),
          stage("mixed", [{"name": "words", "dtype": "bytes", "shape": [-1]}, {"name": "x", "dtype": "float32",
                                                                             "shape": [2]}],
                [{"name": "y", "dtype": "float32", "shape": [2]}, {"name": "tags", "dtype": "bytes", "shape": [2]}])]


class Frame(bytes):
    @property
    def buffer(self) -> memoryview:
        return memoryview(self)


@pytest.fixture
def adm(tmp_path) -> Admission:
    unloaded_model(tmp_path / "m.pt")
    bf16 = {"name": "bf", "versions": [{"version": "1", "path": "m.pt"}], "max_batch_size": 8,
            "inputs": [{"name": "x", "dtype": "bfloat16", "shape": [2]}],
            "outputs": [{"name": "y", "dtype": "bfloat16", "shape": [2]}]}
    cfg = parse_config({"models": [*STAGES, bf16], "server": {"max_request_bytes": MAX_REQUEST,
                        "max_element_bytes": MAX_ELEMENT, "max_elements": 50}}, str(tmp_path))
    registry = Registry(cfg.models)
    for entry in registry.models.values():
        for rec in entry.records.values():
            rec.seen = True
    batcher, stats = Batcher(lambda: 0.0), Stats()
    for m in cfg.models:
        batcher.add_model(m.name, m.max_batch_size, m.max_queue, levels=m.priority_levels)
        stats.model(m.name)
    return Admission(cfg.server, cfg.workers, cfg.models, tenants_of(cfg, lambda: 0.0), registry, batcher, stats,
                     Owed(cfg.server.max_inflight_per_client), lambda: 0.0)


_ids = iter(range(1, 10 ** 9))


def send(adm: Admission, model: str, tensors: list[tuple[str, str, list, bytes]], **kw):
    """Admit a request of (name, dtype, shape, frame) tensors; TensorMeta fields in `kw` by name."""
    output_region = kw.pop("output_region", None)
    metas = [TensorMeta(name=n, dtype=d, shape=s, **kw.get(n, {})) for n, d, s, _ in tensors]
    msg = Infer(v=PROTOCOL_VERSION, id=next(_ids), model=model, inputs=metas, output_region=output_region)
    return adm.admit(b"caller", msg, [Frame(f) for _, _, _, f in tensors])


def refused(adm, model, tensors, **kw) -> TgwError:
    with pytest.raises(TgwError) as info:
        send(adm, model, tensors, **kw)
    return info.value


def test_a_bytes_request_is_queued_as_its_frame(adm):
    frame = pack([b"ab", b"", b"xyz"])
    p = send(adm, "echo", [("data", "bytes", [3], frame)])
    assert bytes(p.tensors[0]) == frame and p.nbytes == [len(frame)] and p.out_nbytes is None and p.rows == 3
    q = send(adm, "echo", [("data", "bytes", [1], pack([b"q"]))])
    assert p.group() == q.group()   # shape []: any requests batch together


def test_mixed_inputs_and_variable_dims(adm):
    words = pack([b"a", b"b", b"c", b"d"])
    p = send(adm, "mixed", [("words", "bytes", [2, 2], words), ("x", "float32", [2, 2], np.zeros(4, "<f4").tobytes())])
    assert p.nbytes == [len(words), 16]
    q = send(adm, "mixed", [("words", "bytes", [2, 1], pack([b"a", b"b"])), ("x", "float32", [2, 2], bytes(16))])
    assert p.group() != q.group()   # a -1 dim: only equal shapes batch


@pytest.mark.parametrize("frame, shape, code, words", [
    (b"\x05\x00", [1], Code.INVALID_ARGUMENT, "inside its 4-byte length"),             # truncated prefix
    (b"\x09\x00\x00\x00abc", [1], Code.INVALID_ARGUMENT, "only 3 bytes follow"),       # length past the end
    (pack([b"a"]) + b"!", [1], Code.INVALID_ARGUMENT, "1 bytes follow the last"),      # trailing bytes
    (pack([b"a", b"b"]), [1], Code.INVALID_ARGUMENT, "follow the last of the 1"),      # too many elements
    (pack([b"a"]), [2], Code.INVALID_ARGUMENT, "element 1 of 2"),                      # too few elements
    (pack([b"x" * (MAX_ELEMENT + 1)]), [1], Code.PAYLOAD_TOO_LARGE, "server.max_element_bytes"),
    (pack([b"x" * 90] * 50), [50], Code.PAYLOAD_TOO_LARGE, "server.max_request_bytes"),   # the total
    (pack([b""] * 51), [51], Code.PAYLOAD_TOO_LARGE, "server.max_elements"),
])
def test_hostile_bytes_frames_are_refused_naming_the_input(adm, frame, shape, code, words):
    err = refused(adm, "echo", [("data", "bytes", shape, frame)])
    assert err.code is code and words in err.message, err.message
    assert "'data'" in err.message or "request carries" in err.message   # the total is the request's


def test_compressed_bytes_inflate_within_the_request_limit(adm):
    frame = pack([b"z" * 90] * 8)
    p = send(adm, "echo", [("data", "bytes", [8], lz4.frame.compress(frame))], data={"compression": "lz4"})
    assert bytes(p.tensors[0]) == frame and p.nbytes == [len(frame)]
    bomb = lz4.frame.compress(pack([b"\x00" * 90] * 45))   # small on the wire, past max_request_bytes inflated
    err = refused(adm, "echo", [("data", "bytes", [45], bomb)], data={"compression": "lz4"})
    assert err.code is Code.PAYLOAD_TOO_LARGE and "inflates past 4096" in err.message
    err = refused(adm, "echo", [("data", "bytes", [8], lz4.frame.compress(frame)[:-6])], data={"compression": "lz4"})
    assert err.code is Code.INVALID_ARGUMENT and "'data'" in err.message
    bad = lz4.frame.compress(pack([b"a"]) + b"junk")   # inflates, then fails the layout check
    err = refused(adm, "echo", [("data", "bytes", [1], bad)], data={"compression": "lz4"})
    assert err.code is Code.INVALID_ARGUMENT and "4 bytes follow" in err.message


def test_wire_dtype_and_output_regions_are_refused_for_bytes(adm):
    err = refused(adm, "echo", [("data", "bytes", [1], pack([b"a"]))], data={"wire_dtype": "bfloat16"})
    assert err.code is Code.INVALID_INPUT_DTYPE and "'data' is bytes" in err.message
    err = refused(adm, "mixed", [("words", "bytes", [1, 1], pack([b"a"])), ("x", "float32", [1, 2], bytes(8))],
                  output_region=RegionSlice(region=1, offset=0, nbytes=4096))
    assert err.code is Code.INVALID_ARGUMENT and "['tags']" in err.message and "region" in err.message


def test_bytes_where_a_model_wants_numbers_and_back(adm):
    err = refused(adm, "bf", [("x", "bytes", [1, 2], pack([b"a", b"b"]))])
    assert err.code is Code.INVALID_INPUT_DTYPE and "data-type is 'BYTES', but model 'bf' expects 'BF16'" in err.message
    err = refused(adm, "echo", [("data", "float32", [1], bytes(4))])
    assert err.code is Code.INVALID_INPUT_DTYPE and "expects 'BYTES'" in err.message


def test_bfloat16_takes_two_bytes_an_element(adm):
    p = send(adm, "bf", [("x", "bfloat16", [3, 2], bytes(12))])
    assert p.nbytes == [12] and p.out_nbytes == [12]
    err = refused(adm, "bf", [("x", "bfloat16", [3, 2], bytes(24))])
    assert err.code is Code.INVALID_ARGUMENT and "Expected 12, got 24" in err.message


def test_arenas_and_output_sizes_of_stages(tmp_path):
    cfg = parse_config({"models": STAGES, "server": {"max_request_bytes": 1 << 20}}, str(tmp_path))
    echo, mixed = cfg.models
    assert input_need(echo, 2, 1 << 20) == align_up(1 << 20)            # sized like a -1 dim
    assert input_need(mixed, 2, 1 << 20) == align_up(1 << 20) + 64
    assert output_need(echo, 2) == VARIABLE_OUTPUT_BYTES
    assert output_need(mixed, 2) == VARIABLE_OUTPUT_BYTES              # its fixed output is small
    assert ModelEntry(echo).output_bytes(4) is None and ModelEntry(mixed).output_bytes(4) is None


@pytest.fixture
def worker():
    seg = Segment.create(new_name("ring"), 2 << 16)
    try:
        yield WorkerHandle(worker_id=0, device="cpu", cpus=[], segment=seg, input_bytes=1 << 16,
                           output_bytes=1 << 16)
    finally:
        try:
            seg.close()
        finally:
            seg.unlink()


def test_a_batch_of_bytes_is_the_frames_back_to_back_and_replies_cut_by_rows(adm, worker):
    ps = [send(adm, "echo", [("data", "bytes", [len(items)], pack(items))])
          for items in ([b"a", b"bb"], [b"ccc"], [b"", b"dddd", b"e"])]
    entry = adm.registry.models["echo"]
    batch = worker.stage(1, ps, entry.inputs)
    (t,) = batch.inputs
    assert (t.dtype, t.shape, t.nbytes) == ("bytes", [6], sum(p.nbytes[0] for p in ps))
    staged = bytes(worker.segment.buf[t.offset:t.offset + t.nbytes])
    assert unpack(staged, 6) == [b"a", b"bb", b"ccc", b"", b"dddd", b"e"]   # self-delimiting: no gather needed
    rows = [[b"A"], [b"BB"], [b"CCC"], [b""], [b"DDDD"], [b"E"]]          # the stage's output, a row each
    out = pack([r[0] for r in rows])
    at = (1 << 16) + 128
    worker.segment.buf[at:at + len(out)] = out
    cuts = [0]
    for r in rows:
        cuts.append(cuts[-1] + len(pack(r)))
    done = Done(batch_id=1, block=128, outputs=[BlockTensor(name="data", dtype="bytes", shape=[6], offset=at,
                                                            nbytes=len(out), cuts=cuts)])
    inflight = worker.finish(done)
    got = {p.req_id: unpack(bytes(views["data"][1]), p.rows) for p, views in worker.output_rows(done, inflight)}
    assert got == {ps[0].req_id: [b"A", b"BB"], ps[1].req_id: [b"CCC"], ps[2].req_id: [b"", b"DDDD", b"E"]}
