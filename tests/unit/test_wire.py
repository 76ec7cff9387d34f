"""The wire contract (shm/wire.py): typed round trips, map-encoded headers with field names,
malformed bytes refused as DecodeError (the error table itself: test_error_table.py)."""
from __future__ import annotations

import msgspec
import pytest

import tgw.client
from tgw.shm import wire
from tgw.shm.errors import error_from_body
from tgw.shm.wire import (PROTOCOL_VERSION, Batch, BlockTensor, ControlReply, DecodeError, Done, ErrorBody, ErrorReply,
                          Health, HealthReply, Heartbeat, Hello, HelloReply, Infer, InferReply, IOSpec, LineGrowth,
                          ListModels, LoaderHello, LoadModel, LoadModels, LoadVersion, Metadata, MetadataReply,
                          LoadPhase, ModelInfo, ModelLoaded, ModelMetadata, ModelSpec, ModelsReply, ModelUnloaded, Release,
                          Scrape, ScrapeReply, Cancel, CancelReply, CudaIpc, Goodbye, RegionReply, RegionSlice,
                          RegisterRegion, UnregisterRegion,
                          Reload, SetTraffic, Snapshot, SnapshotReply, SnapshotRequest, Stats, StatsReply, Status,
                          StatusReply, Stop, TensorMeta, UnloadModel, UnloadVersion, VersionInfo, WorkerFailed,
                          WorkerFault, WorkerHello, WorkerReady, WorkerSnapshot, encode, envelope_decoder,
                          from_worker_decoder,
                          nbytes_of, reply_decoder, request_decoder, to_worker_decoder)
from tgw.shm.wire_worker import GpuReading, Withdraw
from tgw.shm.wire import CancelSequences, GenerateEnd, GenerateOutputs, GenerateParams, GeneratorSpec, GenSeq, Sampling, \
    SeqEnd, StateSpec, StepRows, Steps
from tgw.shm.wire import JobAccepted, JobCancel, JobQuery, JobStatus

V = PROTOCOL_VERSION
x_meta = TensorMeta(name="x", dtype="float32", shape=[2, 256])
io = IOSpec(name="x", dtype="float32", shape=[-1, 256])

REQUESTS = [
    Hello(v=V, id=1, client="pytest"),
    Hello(v=V),
    Infer(v=V, id=7, model="mlp", inputs=[x_meta]),
    Infer(v=V, id=8, model="mlp", inputs=[x_meta, TensorMeta(name="t", dtype="int64", shape=[2, 5],
                                                            compression="lz4")],
          version="2", outputs=["y"], timeout_ms=250, priority=3, compress_outputs=True),
    ListModels(v=V, id=3),
    Health(v=V, id=4),
    Stats(v=V, id=5),
    Status(v=V, id=6),
    Snapshot(v=V, id=7, worker=1),
    Snapshot(v=V, id=8),
    Infer(v=V, id=9, model="mlp", inputs=[x_meta], routing_key="user-42"),
    LoadVersion(v=V, id=10, model="mlp", version="2", path="/m/mlp-2.pt", sha256="a" * 64, weight=10),
    LoadVersion(v=V, model="mlp", version="3"),
    UnloadVersion(v=V, id=11, model="mlp", version="1"),
    UnloadVersion(v=V, model="mlp"),
    SetTraffic(v=V, id=12, model="mlp", weights={"1": 90, "2": 10}),
    Metadata(v=V, id=13, model="mlp"),
    Metadata(v=V),
    Reload(v=V, id=14),
    Scrape(v=V, id=15), Scrape(v=V),
    Infer(v=V, id=16, model="mlp", compress_outputs="auto", output_region=RegionSlice(region=1, offset=64, nbytes=4096),
          inputs=[TensorMeta(name="x", dtype="float32", shape=[2, 4], wire_dtype="bfloat16"),
                  TensorMeta(name="z", dtype="float32", shape=[2, 4], region=1, offset=128)]),
    Infer(v=V, id=17, model="mlp", inputs=[TensorMeta(name="x", dtype="float32", shape=[2, 4], cuda=CudaIpc(
          device=0, device_uuid="GPU-1", handle=b"h" * 64, storage_bytes=32, storage_offset_bytes=0))],
          output_cuda={"y": CudaIpc(device=0, device_uuid="GPU-1", handle=b"o" * 64, storage_bytes=80,
                                    storage_offset_bytes=512, event_handle=b"e" * 64, event_sync_required=True)}),
    Cancel(v=V, id=18, ids=[3, 4]),
    Goodbye(v=V), Goodbye(v=V, id=19),
    RegisterRegion(v=V, id=20, fd=7, nbytes=1 << 20, name="pytest"),
    UnregisterRegion(v=V, id=21, region=1),
    Infer(v=V, id=22, model="gpt", inputs=[TensorMeta(name="prompt", dtype="int64", shape=[1, 5])],
          generate=GenerateParams(max_outputs=16, sampling=Sampling(temperature=0.7, top_k=40, top_p=0.9, seed=7,
                                                                    stop_tokens=[0], stop_sequences=[[5, 6]]))),
    Infer(v=V, id=23, model="gpt", inputs=[x_meta], job=True),
    JobQuery(v=V, id=24, job_id="b00t1234.secret", since=3, wait_ms=500, tenant="acme"),
    JobCancel(v=V, id=25, job_id="b00t1234.secret"),
]

META = ModelMetadata(name="mlp", inputs=[io], outputs=[io], max_batch_size=32, default_version="2",
                     residency="always", versions=[VersionInfo(version="2", path="/m/mlp-2.pt", state="ready",
                                                               weight=100, workers={"worker0[cpu]": "loaded"},
                                                               bytes=1 << 20, loads=1, last_load_ms=12.5)])

REPLIES = [
    HelloReply(v=V, id=1, server="tgw 0.1", max_request_bytes=64 << 20),
    CancelReply(v=V, id=18, cancelled=1, running=1),
    RegionReply(v=V, id=20, region=1, nbytes=1 << 20), RegionReply(v=V, id=21, region=1, nbytes=1 << 20, registered=False),
    InferReply(v=V, id=7, model="mlp", version="1", outputs=[TensorMeta(name="y", dtype="float32", shape=[2, 10])]),
    ErrorReply(v=V, id=9, error=ErrorBody(code="MODEL_NOT_FOUND", message="no model 'x'", retryable=False,
                                          details={"model": "x", "known": ["mlp"]})),
    ErrorReply(v=V, id=10, error=ErrorBody(code="INTERNAL", message="boom")),
    ModelsReply(v=V, id=3, models=[ModelInfo(name="mlp", versions=["1", "2"], default_version="2", max_batch_size=32,
                                             inputs=[io], outputs=[IOSpec(name="y", dtype="float32", shape=[10])],
                                             ready=True)]),
    ModelsReply(v=V, id=3, models=[]),
    HealthReply(v=V, id=4, live=True, ready=False, models={"mlp": True}, workers={"0": "ready"}),
    HealthReply(v=V, id=4, live=True, ready=True),
    StatsReply(v=V, id=5, models={"mlp": {"requests": 3, "errors": {"INTERNAL": 1}}},
               processes=[{"role": "broker", "pid": 1, "device": None}]),
    StatusReply(v=V, id=6, phase="serving", uptime_s=12.5, models={"mlp": {"ready": True, "queued": 0}},
                workers=[{"name": "worker0[cpu]", "pid": 7, "state": "ready", "heartbeat_age_s": 0.4}]),
    SnapshotReply(v=V, id=7, files=["/var/lib/tgw/snapshots/a.json"], missing=["worker1[cpu]"]),
    MetadataReply(v=V, id=13, models=[META]),
    ControlReply(v=V, id=10, message="mlp:2 serves every request", model=META, details={"events": []}),
    ControlReply(v=V, id=14, message="reloaded"),
    ScrapeReply(v=V, id=15, text="# TYPE tgw_requests_total counter\n"),
    ErrorReply(v=V, id=9, error=ErrorBody(code="OVERLOADED", message="full"), traceparent="00-" + "1" * 32 + "-"
               + "2" * 16 + "-01"),
    GenerateOutputs(v=V, id=22, first=3, count=2, outputs=[TensorMeta(name="token", dtype="int64", shape=[2])]),
    GenerateEnd(v=V, id=22, model="gpt", version="1", reason="max_outputs", outputs=16, seed=7, first_output_ms=2.5,
                total_ms=40.0, resumed=1),
    JobAccepted(v=V, id=23, job_id="b00t1234.secret", model="gpt", generate=True, keep_s=600.0),
    JobStatus(v=V, id=24, job_id="b00t1234.secret", model="gpt", state="running", generate=True, version="1",
              outputs=[TensorMeta(name="token", dtype="int64", shape=[2])], first=3, count=2, total=5,
              end={"reason": "max_outputs"}, age_ms=12.5, run_ms=None, expires_in_s=None),
    JobStatus(v=V, id=26, job_id="b00t1234.secret", model="mlp", state="failed",
              error=ErrorBody(code="DEADLINE_EXCEEDED", message="late"), run_ms=3.0, expires_in_s=599.0),
]

TO_WORKER = [
    LoadModels(models=[ModelSpec(name="mlp", version="1", path="/m.pt", inputs=[io], outputs=[io],
                                 warmup_batch_sizes=[1, 8])]),
    Batch(batch_id=1, model="mlp", version="1", rows=2, block=128,
          inputs=[BlockTensor(name="x", dtype="float32", shape=[2, 256], offset=128, nbytes=2048)]),
    Release(blocks=[0, 64, 4096]),
    Stop(),
    SnapshotRequest(snapshot_id=3, top=10),
    LoadModel(spec=ModelSpec(name="mlp", version="2", path="/m.pt", inputs=[io], outputs=[io], sha256="b" * 64)),
    UnloadModel(key="mlp:1"),
    Withdraw(batch_id=7, requests=[0, 2]),
    CancelSequences(seqs=[4, 5], reason="client_gone"),
    LoadModel(spec=ModelSpec(name="gpt", version="1", path="", inputs=[io], outputs=[io], format="stage",
                             handler="tgw.workers.demo_generator:TinyGPT",
                             generator=GeneratorSpec(state=[StateSpec(name="kv", dtype="float32", shape=[2, 64, 8])],
                                                     max_sequences=64, max_length=64, end_tokens=[0]))),
    Batch(batch_id=9, model="gpt", version="1", rows=1, block=0,
          inputs=[BlockTensor(name="prompt", dtype="int64", shape=[1, 5], offset=0, nbytes=40)],
          sequences=[GenSeq(seq=3, max_outputs=8, sampling=Sampling(seed=1), delivered=2, prefix=[b"\0" * 16])]),
]

FROM_WORKER = [
    WorkerHello(v=V, worker_id=0, pid=1234),
    WorkerReady(worker_id=0, models=["mlp"]),
    WorkerFailed(worker_id=1, model="mlp", error="RuntimeError: x"),
    WorkerFault(worker_id=1, batch_id=4, error="CUDA error: misaligned address", kind="misaligned address"),
    Done(batch_id=1, outputs=[BlockTensor(name="y", dtype="float32", shape=[2, 10], offset=0, nbytes=80)],
         block=0, compute_us=75),
    Done(batch_id=2, error=ErrorBody(code="MODEL_EXECUTION_ERROR", message="bad")),
    Heartbeat(worker_id=0, pid=1234, sent=5.5, rss=1 << 26, cpu_s=1.25, fds=12, threads=4, batches=9,
              batch_id=10, batch_since=5.0),
    Heartbeat(worker_id=1, pid=1235, sent=6.5, rss=1 << 26, cpu_s=1.5, fds=12, threads=5, batches=3,
              cuda_allocated=1 << 20, cuda_reserved=1 << 21, gpu_ooms=2,
              gpu=GpuReading(memory_used=3 << 30, memory_total=80 << 30, utilization=0.42, temperature_c=61.0,
                             power_w=250.5)),
    Heartbeat(worker_id=1, pid=1235, sent=7.5, rss=1 << 26, cpu_s=1.5, fds=12, threads=5, batches=3,
              gpu=GpuReading(memory_used=3 << 30, memory_total=80 << 30)),   # a device without the rest
    WorkerSnapshot(snapshot_id=3, worker_id=0, tracing_since=4.0, traced_bytes=2048,
                   growth=[LineGrowth(where="m.py:3", size_diff=1024, count_diff=2)]),
    WorkerReady(worker_id=0, models=["mlp:1"], sizes={"mlp:1": 1024}),
    LoaderHello(worker_id=0),
    ModelLoaded(worker_id=0, key="mlp:2", bytes=4096, rss_before=1 << 26, rss_after=1 << 27, load_ms=20.5),
    ModelLoaded(worker_id=0, key="mlp:3", error="RuntimeError: x", reason="warmup"),
    ModelLoaded(worker_id=0, key="mlp:4", bytes=64, load_ms=12.5, warm_ms=2.5, startup=True),
    LoadPhase(worker_id=0, key="mlp:4", phase="warming", seconds=10.0),
    ModelUnloaded(worker_id=0, key="mlp:1", rss_before=1 << 27, rss_after=1 << 26),
    Steps(worker_id=0, key="gpt:1", seqs=[3, 4], positions=[0, 5],
          outputs=[StepRows(name="token", dtype="int64", shape=[2], data=b"\1" * 16)],
          ended=[SeqEnd(seq=4, reason="max_outputs"), SeqEnd(seq=5, reason="error",
                                                            error=ErrorBody(code="MODEL_EXECUTION_ERROR", message="x"))],
          active=1, slots=64, freed=1, step_us=1200, prefilled=1),
]


def _id(m) -> str:
    return type(m).__name__


@pytest.mark.parametrize("msg", REQUESTS, ids=_id)
def test_request_round_trip(msg):
    raw = encode(msg)
    back = request_decoder.decode(raw)
    assert type(back) is type(msg) and back == msg


@pytest.mark.parametrize("msg", REPLIES, ids=_id)
def test_reply_round_trip(msg):
    back = reply_decoder.decode(encode(msg))
    assert type(back) is type(msg) and back == msg


@pytest.mark.parametrize("msg", TO_WORKER, ids=_id)
def test_to_worker_round_trip(msg):
    assert to_worker_decoder.decode(encode(msg)) == msg


@pytest.mark.parametrize("msg", FROM_WORKER, ids=_id)
def test_from_worker_round_trip(msg):
    assert from_worker_decoder.decode(encode(msg)) == msg


def test_every_request_and_reply_type_covered():
    import typing
    assert {type(m) for m in REQUESTS} == set(typing.get_args(wire.Request))
    assert {type(m) for m in REPLIES} == set(typing.get_args(wire.Reply))
    assert {type(m) for m in TO_WORKER} == set(typing.get_args(wire.ToWorker))
    assert {type(m) for m in FROM_WORKER} == set(typing.get_args(wire.FromWorker))


@pytest.mark.parametrize("msg", REQUESTS + REPLIES + TO_WORKER + FROM_WORKER, ids=_id)
def test_headers_are_maps_with_field_names(msg):
    raw = msgspec.msgpack.decode(encode(msg))
    assert isinstance(raw, dict)
    assert isinstance(raw["op"], str)
    # every key is a declared field name (or the tag), never a positional index
    names = set(msg.__struct_fields__) | {"op"}
    assert set(raw) <= names
    for k, v in raw.items():
        if k != "op":
            assert isinstance(k, str)


def test_infer_map_readable_by_any_client():
    raw = msgspec.msgpack.decode(encode(REQUESTS[3]))
    assert raw["op"] == "infer" and raw["v"] == V and raw["id"] == 8 and raw["model"] == "mlp"
    assert raw["inputs"][1] == {"name": "t", "dtype": "int64", "shape": [2, 5], "compression": "lz4"}
    assert raw["timeout_ms"] == 250


def test_foreign_client_map_decodes():
    """A header built by a plain MessagePack library (a dict), as a client in another language would."""
    raw = msgspec.msgpack.encode({"op": "infer", "v": V, "id": 1, "model": "mlp",
                                  "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 4]}],
                                  "future_field": {"ignored": True}})
    msg = request_decoder.decode(raw)
    assert isinstance(msg, Infer) and msg.inputs[0].shape == [1, 4] and msg.version is None
    assert msg.priority == 0 and msg.outputs is None


def test_defaults_are_omitted():
    assert msgspec.msgpack.decode(encode(Hello(v=V))) == {"op": "hello", "v": V}


MALFORMED = [
    b"",
    b"\xc1",                                           # never-used byte
    b"\x92\x01\x02",                                   # an array, not a map
    b"\xa5hello",                                      # a bare string
    b"\x85",                                           # truncated map
    encode(REQUESTS[2])[:-3],                          # truncated message
    encode(REQUESTS[2]) + b"\x00",                     # trailing bytes
    msgspec.msgpack.encode({"v": V, "id": 1}),         # no op tag
    msgspec.msgpack.encode({"op": "nope", "v": V}),    # unknown op
    msgspec.msgpack.encode({"op": "infer", "v": V}),   # missing required fields
    msgspec.msgpack.encode({"op": "infer", "v": "1", "id": 1, "model": "m", "inputs": []}),      # wrong type
    msgspec.msgpack.encode({"op": "infer", "v": V, "id": 1, "model": "m", "inputs": [{"name": "x"}]}),
    msgspec.msgpack.encode({"op": "infer", "v": V, "id": 1, "model": "m", "inputs": [],
                            "priority": 1.5}),
    msgspec.msgpack.encode({"op": 7, "v": V}),
    b"\xd4\x01\x00",                                   # an ext type: never turned into an object
    msgspec.msgpack.encode(msgspec.msgpack.Ext(1, b"\x80\x04N.")),  # pickle-looking ext payload
]


@pytest.mark.parametrize("raw", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_requests_raise_decode_error(raw):
    with pytest.raises(DecodeError):
        request_decoder.decode(raw)


@pytest.mark.parametrize("raw", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_replies_raise_decode_error(raw):
    with pytest.raises(DecodeError):
        reply_decoder.decode(raw)


def test_reply_is_not_a_request():
    with pytest.raises(DecodeError):
        request_decoder.decode(encode(REPLIES[2]))   # op "error" is no request


def test_envelope_reads_what_it_can():
    raw = msgspec.msgpack.encode({"op": "infer", "v": V, "id": 42, "model": 5})
    with pytest.raises(DecodeError):
        request_decoder.decode(raw)
    env = envelope_decoder.decode(raw)
    assert env.id == 42 and env.op == "infer" and env.v == V


def test_decode_error_tuple():
    assert isinstance(DecodeError, tuple)
    assert msgspec.DecodeError in DecodeError and msgspec.ValidationError in DecodeError


def test_protocol_version_and_dtypes():
    assert isinstance(PROTOCOL_VERSION, int) and PROTOCOL_VERSION >= 1
    assert wire.DTYPE_SIZES["float32"] == 4 and wire.DTYPE_SIZES["bool"] == 1
    assert wire.DTYPE_SIZES["float16"] == 2 and wire.DTYPE_SIZES["int64"] == 8
    assert nbytes_of("float32", [2, 256]) == 2048
    assert nbytes_of("int64", []) == 8
    assert nbytes_of("float16", [3, 0]) == 0


def test_error_body_round_trip_to_exception():
    body = reply_decoder.decode(encode(next(r for r in REPLIES if isinstance(r, ErrorReply)))).error
    e = error_from_body(body)
    assert isinstance(e, tgw.client.ModelNotFoundError) and e.details["known"] == ["mlp"]


def test_heartbeat_of_a_worker_before_gpu_figures_decodes():
    """A heartbeat as a CPU worker, or one of a release before GPU figures, sends it: no gpu, no gpu_ooms."""
    old = {"op": "w_beat", "worker_id": 0, "pid": 7, "sent": 1.0, "rss": 4096, "cpu_s": 0.5, "fds": 9,
           "threads": 3, "batches": 0, "cuda_allocated": 0, "output_used": 0}
    beat = from_worker_decoder.decode(msgspec.msgpack.encode(old))
    assert isinstance(beat, Heartbeat) and beat.gpu is None and beat.gpu_ooms == 0
    assert "gpu" not in msgspec.msgpack.decode(encode(beat)) and "gpu_ooms" not in msgspec.msgpack.decode(encode(beat))


def test_gpu_reading_leaves_out_what_the_device_does_not_report():
    partial = [m for m in FROM_WORKER if isinstance(m, Heartbeat) and m.gpu is not None][-1]
    raw = msgspec.msgpack.decode(encode(partial))
    assert raw["gpu"] == {"memory_used": 3 << 30, "memory_total": 80 << 30}
    beat = from_worker_decoder.decode(msgspec.msgpack.encode({**raw, "gpu": {"temperature_c": 55}}))
    assert beat.gpu == GpuReading(temperature_c=55.0) and beat.gpu.power_w is None
