"""The wire contract: every message on every socket, declared once (docs/ARCHITECTURE.md, "The wire contract"; docs/PROTOCOL.md).

MessagePack, structs encoded as maps with field names, a tag field `op` naming the message.
A message is a multipart ZeroMQ message: [header][tensor bytes 0][tensor bytes 1]... where
tensor i of the header's list travels in frame i + 1 as raw little-endian C-order bytes
(lz4-compressed when the tensor's `compression` says so). Decoding never executes code.
docs/PROTOCOL.md documents this for clients in other languages.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

import msgspec

# the contract's other parts, re-exported: import every message from here
from .wire_base import (BYTES, COMPRESSIONS, DTYPE_SIZES, DTYPES, PROTOCOL_VERSION, SUPPORTED_VERSIONS, WIRE_DTYPES,  # noqa: F401
                        CudaIpc, ErrorBody, IOSpec, Struct, TensorMeta, as_builtins, model_key, nbytes_of,
                        split_model_key)
from .wire_control import (ControlReply, LoadVersion, Metadata, MetadataReply, ModelMetadata, Reload,  # noqa: F401
                           RolloutPolicy, Scrape, ScrapeReply, SetTraffic, UnloadVersion, VersionInfo)
from .wire_generate import (CancelSequences, GenerateEnd, GenerateOutputs, GenerateParams, GeneratorSpec,  # noqa: F401
                            GenSeq, Sampling, SeqEnd, StateSpec, StepRows, Steps)
from .wire_jobs import JOB_STATES, JobAccepted, JobCancel, JobQuery, JobStatus  # noqa: F401
from .wire_sequence import (CONTROL_KINDS, ControlSpec, CorrId, ImplicitStateSpec, SeqStep, SequenceRef,  # noqa: F401
                            SequenceSpec)
from .wire_worker import (Batch, BlockTensor, Done, Footprint, GpuReading, Heartbeat, LineGrowth, LoaderHello, LoadModel,  # noqa: F401
                          LoadModels, LoadPhase, ModelLoaded, ModelSpec, ModelUnloaded, Release, Replay, ReplayBatch,
                          ReplayReport, SnapshotRequest, Stop, UnloadModel, Withdraw, WorkerFailed, WorkerFault,
                          WorkerHello, WorkerReady, WorkerSnapshot)

# ---- client -> broker ------------------------------------------------------------------------

class Hello(Struct, tag_field="op", tag="hello"):
    v: int
    id: int = 0
    client: str = ""
    token: Optional[str] = None              # the shared auth token (server.auth_token_file)


class Infer(Struct, tag_field="op", tag="infer"):
    v: int
    id: int
    model: str
    inputs: list[TensorMeta]
    version: Optional[str] = None
    outputs: Optional[list[str]] = None      # subset of declared outputs; None = all
    timeout_ms: Optional[int] = None         # relative deadline, from the broker's receipt
    priority: int = 0                        # 0 is the highest level (the model's priority_levels)
    # reply frames lz4-compressed: True, all; "auto": those large and compressible enough
    compress_outputs: Union[bool, Literal["auto"]] = False
    token: Optional[str] = None              # the shared auth token (server.auth_token_file)
    tenant: Optional[str] = None             # whose quota the request counts against (config `tenants`)
    routing_key: Optional[str] = None        # with no version named: the same key, the same version (canary)
    traceparent: Optional[str] = None        # W3C trace context of the caller's span; invalid: ignored
    output_region: Optional["RegionSlice"] = None    # write the outputs there (else: frames)
    output_cuda: dict[str, CudaIpc] = {}     # output name -> the caller's CUDA buffer to write it into
    # a generation (the model is a generator): answered by GenerateOutputs messages, then GenerateEnd
    generate: Optional[GenerateParams] = None
    # a step of a sequence model (shm/wire_sequence.py): its correlation id and start/end flags
    sequence: Optional[SequenceRef] = None
    # a job (docs/JOBS.md): answered at once with the job's id; its result is fetched later
    job: bool = False


class RegionSlice(Struct):
    """Bytes [offset, offset + nbytes) of a registered region."""
    region: int
    offset: int
    nbytes: int


class Cancel(Struct, tag_field="op", tag="cancel"):
    """Drop the caller's requests `ids` that are still queued; answered with `cancel`."""
    v: int
    id: int
    ids: list[int]
    token: Optional[str] = None


class Goodbye(Struct, tag_field="op", tag="bye"):
    """The caller is closing: drop its queued requests. Not answered."""
    v: int
    id: int = 0
    token: Optional[str] = None


class RegisterRegion(Struct, tag_field="op", tag="region"):
    """Register a shared-memory region: the caller's open memfd `fd` (sealed against shrinking),
    which the broker opens through /proc/<caller's pid>/fd/<fd>; `nbytes` its size."""
    v: int
    id: int
    fd: int
    nbytes: int
    name: str = ""                           # the caller's label, for status and logs
    token: Optional[str] = None


class UnregisterRegion(Struct, tag_field="op", tag="unregion"):
    v: int
    id: int
    region: int
    token: Optional[str] = None


class ListModels(Struct, tag_field="op", tag="models"):
    v: int
    id: int = 0
    token: Optional[str] = None              # the shared auth token (server.auth_token_file)


class Health(Struct, tag_field="op", tag="health"):
    v: int
    id: int = 0
    token: Optional[str] = None              # the shared auth token (server.auth_token_file)


class Stats(Struct, tag_field="op", tag="stats"):
    v: int
    id: int = 0
    token: Optional[str] = None              # the shared auth token (server.auth_token_file)


class Status(Struct, tag_field="op", tag="status"):
    v: int
    id: int = 0
    token: Optional[str] = None              # the shared auth token (server.auth_token_file)


class Snapshot(Struct, tag_field="op", tag="snapshot"):
    """Take a memory snapshot of one worker (its index) or all; answered once written."""
    v: int
    id: int = 0
    worker: Optional[int] = None
    token: Optional[str] = None              # the shared auth token (server.auth_token_file)


CONTROL_OPS = (LoadVersion, UnloadVersion, SetTraffic, Reload)
Request = Union[Hello, Infer, ListModels, Health, Stats, Status, Snapshot, LoadVersion, UnloadVersion, SetTraffic,
                Metadata, Reload, Scrape, Cancel, Goodbye, RegisterRegion, UnregisterRegion, JobQuery, JobCancel]


class Envelope(Struct):
    """The few fields read from a header that failed typed decoding, to address the error."""
    v: Any = None
    id: Any = 0
    op: Any = None


# ---- broker -> client ------------------------------------------------------------------------

class HelloReply(Struct, tag_field="op", tag="hello"):
    v: int
    id: int
    server: str
    max_request_bytes: int
    # infers one connection may have admitted and unanswered (server.max_inflight_per_client): the
    # client queues beyond it; None from a broker before this field (no queueing)
    max_inflight_per_client: Optional[int] = None


class InferReply(Struct, tag_field="op", tag="infer"):
    v: int
    id: int
    model: str
    version: str
    outputs: list[TensorMeta]
    traceparent: Optional[str] = None        # the broker's request span (tracing on), else the caller's own


class ErrorReply(Struct, tag_field="op", tag="error"):
    v: int
    id: int
    error: ErrorBody
    traceparent: Optional[str] = None        # an admitted request's, as InferReply's


class CancelReply(Struct, tag_field="op", tag="cancel"):
    v: int
    id: int
    cancelled: int                      # of the ids: dropped from their queues, never to run
    running: int = 0                    # already on a worker (their replies will come)


class RegionReply(Struct, tag_field="op", tag="region"):
    v: int
    id: int
    region: int                         # the handle tensors name (TensorMeta.region)
    nbytes: int
    registered: bool = True             # False: the answer to unregion


class ModelInfo(Struct):
    name: str
    versions: list[str]
    default_version: str
    max_batch_size: int
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    ready: bool
    wire_dtypes: list[str] = []         # reduced precisions its float32 inputs may travel in
    steps: list[str] = []               # a pipeline's step names, in order ([]: a model or stage)


class ModelsReply(Struct, tag_field="op", tag="models"):
    v: int
    id: int
    models: list[ModelInfo]


class HealthReply(Struct, tag_field="op", tag="health"):
    v: int
    id: int
    live: bool
    ready: bool
    models: dict[str, bool] = {}
    workers: dict[str, str] = {}
    # per device (cuda:N, cpu): state (serving, starting, restarting, faulted, out_of_service), uuid,
    # workers, faults, reason, models_lost (those served without it while it does not serve)
    devices: dict[str, dict[str, Any]] = {}


class StatsReply(Struct, tag_field="op", tag="stats"):
    v: int
    id: int
    # model -> counters: requests, batches, rows, errors{code: n}, batch_sizes{size: n}, shed{priority: n},
    # fallbacks, queued, queued_by_priority, cost_model, concurrency (adaptive limit), breakers{version: ...}
    models: dict[str, dict[str, Any]]
    processes: list[dict[str, Any]]  # {role, pid, device, state (workers)}
    errors: dict[str, int] = {}      # code -> n for requests that named no served model
    refused: dict[str, int] = {}     # kind -> n: input refused before any queue (malformed, limits, auth)
    dropped: dict[str, int] = {}     # reason -> n: replies not delivered (slow reader, caller gone)
    clients: dict[str, int] = {}     # connected, max_clients, owed (requests admitted, not yet answered)
    tenants: dict[str, dict[str, Any]] = {}   # name -> rate, burst, tokens, inflight, admitted, limited
    # reason -> n: queued requests dropped unrun (cancelled, client_closed, client_gone)
    abandoned: dict[str, int] = {}
    regions: dict[str, int] = {}     # registered, bytes, registrations, refused, swept
    # model -> where -> n: requests withdrawn because nobody waits for them, by where each was then:
    # queued, staged (taken out of its batch before launch), computing (its answer dropped), pipeline
    cancelled: dict[str, dict[str, int]] = {}


class StatusReply(Struct, tag_field="op", tag="status"):
    """What an operator asks of a running broker (`tgw-broker status`)."""
    v: int
    id: int
    phase: str                          # starting, serving or stopping
    uptime_s: float
    # per worker: name, pid, device, state, models, inflight, restarts, last_death, benched,
    # heartbeat_age_s, and from its last heartbeat rss, cpu_s, fds, threads, batches, busy_s
    workers: list[dict[str, Any]]
    # per model: default_version, versions, ready, queued, requests, replies, errors, and its
    # response cache (null: off): entries, bytes, hits, misses, evictions by reason, ...
    models: dict[str, dict[str, Any]]
    snapshots: list[str] = []           # the most recent snapshot files, newest last
    # the config file and the last reload (SIGHUP or `reload`): path, at_s (uptime), ok, message
    reload: dict[str, Any] = {}
    # recent model lifecycle events, oldest first: at_s, event (load, load_failed, unload, evict,
    # swap, traffic, reload), model, version, worker, ms, bytes, message
    events: list[dict[str, Any]] = []
    http: str = ""                      # the HTTP face's address (http://host:port); "" when off
    # per pipeline: version, ready, requests, replies, errors{code: n}, inflight, and per step: model,
    # sent, ok, failed, latency_ms {mean, p99}
    pipelines: dict[str, dict[str, Any]] = {}
    grpc: str = ""                      # the gRPC face's address (host:port); "" when off
    # TorchServe's APIs: "http://host:INFERENCE http://host:MANAGEMENT"; "" when off
    torchserve: str = ""
    devices: dict[str, dict[str, Any]] = {}   # as HealthReply.devices
    # sticky CUDA errors: total, by_device, out_of_service {device: reason, left_s}, recent [records]
    cuda_faults: dict[str, Any] = {}
    # shadows (active, and the last ended) with their comparisons, guarded rollouts, their decisions
    rollouts: dict[str, Any] = {}
    # polled jobs (docs/JOBS.md): live, done (kept), bytes, and counts: submitted, expired, evicted, ...
    jobs: dict[str, Any] = {}
    # front processes (docs/FRONTS.md): configured, alive, restarts, ready, public, lives [{index, pid, ...}]
    fronts: dict[str, Any] = {}
    # collection pauses (shm/gc_watch.py): {"broker": figures, "workers": {worker id: figures}}
    gc: dict[str, Any] = {}


class SnapshotReply(Struct, tag_field="op", tag="snapshot"):
    v: int
    id: int
    files: list[str]                    # the JSON files written, one per worker
    missing: list[str] = []             # workers that did not answer in time


Reply = Union[HelloReply, InferReply, ErrorReply, ModelsReply, HealthReply, StatsReply, StatusReply, SnapshotReply,
              MetadataReply, ControlReply, ScrapeReply, CancelReply, RegionReply, GenerateOutputs, GenerateEnd,
              JobAccepted, JobStatus]


ToWorker = Union[LoadModels, Batch, Release, Stop, SnapshotRequest, LoadModel, UnloadModel, Withdraw, CancelSequences]
FromWorker = Union[WorkerHello, WorkerReady, WorkerFailed, WorkerFault, Done, Heartbeat, WorkerSnapshot, LoaderHello,
                   LoadPhase, ModelLoaded, ModelUnloaded, Steps]

encoder = msgspec.msgpack.Encoder()
encode = encoder.encode
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
envelope_decoder = msgspec.msgpack.Decoder(Envelope)
to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)
# RecursionError: msgspec recurses once per nesting level, so ~1,000 nested maps (3 KB) exhaust the stack
DecodeError = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


