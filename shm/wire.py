"""The wire contract: every message on every socket, declared once (DESIGN.md section 3).

MessagePack, structs encoded as maps with field names, a tag field `op` naming the message.
A message is a multipart ZeroMQ message: [header][tensor bytes 0][tensor bytes 1]... where
tensor i of the header's list travels in frame i + 1 as raw little-endian C-order bytes
(lz4-compressed when the tensor's `compression` says so). Decoding never executes code.
docs/PROTOCOL.md documents this for clients in other languages.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

PROTOCOL_VERSION = 1

# Tensor dtypes tgw accepts, by numpy name; bytes per element.
DTYPE_SIZES: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "float32": 4, "float64": 8,
}
COMPRESSIONS = ("lz4",)


class Struct(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    pass


class TensorMeta(Struct):
    name: str
    dtype: str
    shape: list[int]
    compression: Optional[str] = None  # "lz4": the frame is an lz4 frame of the raw bytes


class ErrorBody(Struct):
    code: str
    message: str
    retryable: bool = False
    details: dict[str, Any] = {}


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
    compress_outputs: bool = False           # reply frames lz4-compressed
    token: Optional[str] = None              # the shared auth token (server.auth_token_file)
    tenant: Optional[str] = None             # whose quota the request counts against (config `tenants`)
    routing_key: Optional[str] = None        # with no version named: the same key, the same version (canary)


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


# ---- operator control (docs/PROTOCOL.md §5.6): refused on a tcp:// listener without server.auth_token_file

class LoadVersion(Struct, tag_field="op", tag="load"):
    """Load `version` of a declared model on every worker serving it; answered once done.
    weight None: a hot swap (the new version takes every request that names no version, the
    versions that had such traffic drain and unload); a weight: added beside them with it."""
    v: int
    model: str
    version: str
    id: int = 0
    path: Optional[str] = None               # inside model_roots; None: the path the config declared
    sha256: Optional[str] = None
    weight: Optional[int] = None
    token: Optional[str] = None


class UnloadVersion(Struct, tag_field="op", tag="unload"):
    """Drain and unload one version (or, version None, every version) of a model; answered once freed."""
    v: int
    model: str
    id: int = 0
    version: Optional[str] = None
    token: Optional[str] = None


class SetTraffic(Struct, tag_field="op", tag="traffic"):
    """Replace the weights of the versions requests that name no version are split over."""
    v: int
    model: str
    weights: dict[str, int]
    id: int = 0
    token: Optional[str] = None


class Metadata(Struct, tag_field="op", tag="metadata"):
    """One model's metadata (or every model's, model None)."""
    v: int
    id: int = 0
    model: Optional[str] = None
    token: Optional[str] = None


class Reload(Struct, tag_field="op", tag="reload"):
    """Re-read the config file and apply the difference, as SIGHUP does; answered once applied."""
    v: int
    id: int = 0
    token: Optional[str] = None


CONTROL_OPS = (LoadVersion, UnloadVersion, SetTraffic, Reload)
Request = Union[Hello, Infer, ListModels, Health, Stats, Status, Snapshot, LoadVersion, UnloadVersion, SetTraffic,
                Metadata, Reload]


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


class InferReply(Struct, tag_field="op", tag="infer"):
    v: int
    id: int
    model: str
    version: str
    outputs: list[TensorMeta]


class ErrorReply(Struct, tag_field="op", tag="error"):
    v: int
    id: int
    error: ErrorBody


class IOSpec(Struct):
    name: str
    dtype: str
    shape: list[int]  # without the batch dimension; -1 = variable


class ModelInfo(Struct):
    name: str
    versions: list[str]
    default_version: str
    max_batch_size: int
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    ready: bool


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


class StatusReply(Struct, tag_field="op", tag="status"):
    """What an operator asks of a running broker (`tgw-broker status`)."""
    v: int
    id: int
    phase: str                          # starting, serving or stopping
    uptime_s: float
    # per worker: name, pid, device, state, models, inflight, restarts, last_death, benched,
    # heartbeat_age_s, and from its last heartbeat rss, cpu_s, fds, threads, batches, busy_s
    workers: list[dict[str, Any]]
    # per model: default_version, versions, ready, queued, requests, replies, errors
    models: dict[str, dict[str, Any]]
    snapshots: list[str] = []           # the most recent snapshot files, newest last
    # the config file and the last reload (SIGHUP or `reload`): path, at_s (uptime), ok, message
    reload: dict[str, Any] = {}
    # recent model lifecycle events, oldest first: at_s, event (load, load_failed, unload, evict,
    # swap, traffic, reload), model, version, worker, ms, bytes, message
    events: list[dict[str, Any]] = []


class SnapshotReply(Struct, tag_field="op", tag="snapshot"):
    v: int
    id: int
    files: list[str]                    # the JSON files written, one per worker
    missing: list[str] = []             # workers that did not answer in time


class VersionInfo(Struct):
    version: str
    path: str
    state: str                          # loading, ready, draining (being unloaded)
    weight: int = 0                     # share of the requests that name no version (of the weights' sum)
    sha256: Optional[str] = None
    workers: dict[str, str] = {}        # worker name -> loaded, loading, unloading, evicting
    bytes: int = 0                      # parameter and buffer bytes (measured at load; else the file size)
    loads: int = 0
    evictions: int = 0
    last_load_ms: float = 0.0


class ModelMetadata(Struct):
    name: str
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    max_batch_size: int
    default_version: Optional[str]      # the heaviest weight's version; None while no version is loaded
    residency: str                      # always or on_demand
    versions: list[VersionInfo]


class MetadataReply(Struct, tag_field="op", tag="metadata"):
    v: int
    id: int
    models: list[ModelMetadata]


class ControlReply(Struct, tag_field="op", tag="control"):
    """A control op done: what happened, in words and figures; `model` as it is now."""
    v: int
    id: int
    message: str
    model: Optional[ModelMetadata] = None
    details: dict[str, Any] = {}


Reply = Union[HelloReply, InferReply, ErrorReply, ModelsReply, HealthReply, StatsReply, StatusReply, SnapshotReply,
              MetadataReply, ControlReply]


# ---- broker <-> worker -----------------------------------------------------------------------

class ModelSpec(Struct):
    name: str
    version: str
    path: str
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    warmup_batch_sizes: list[int] = []
    sha256: Optional[str] = None   # checked by the worker on the very bytes it loads


class BlockTensor(Struct):
    """A tensor laid in a ring arena: `nbytes` bytes at byte `offset` of the arena."""
    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


class WorkerHello(Struct, tag_field="op", tag="w_hello"):
    v: int
    worker_id: int
    pid: int


class LoadModels(Struct, tag_field="op", tag="w_load"):
    models: list[ModelSpec]


class WorkerReady(Struct, tag_field="op", tag="w_ready"):
    worker_id: int
    models: list[str]
    sizes: dict[str, int] = {}      # model key -> parameter and buffer bytes


# Runtime loads go over the worker's loader socket (identity: the worker's + b"~load"), served
# by a thread of its own so batches keep running while a model loads.

class LoaderHello(Struct, tag_field="op", tag="w_loader"):
    """The loader thread is connected: the broker may send it loads."""
    worker_id: int


class LoadModel(Struct, tag_field="op", tag="w_load1"):
    spec: ModelSpec


class UnloadModel(Struct, tag_field="op", tag="w_unload"):
    key: str                        # "name:version"; the broker has no batch of it in flight


class ModelLoaded(Struct, tag_field="op", tag="w_loaded"):
    worker_id: int
    key: str
    error: Optional[str] = None     # None: loaded and warmed up, serving from now on
    reason: str = ""                # with an error: file, checksum, load, warmup, out_of_memory
    bytes: int = 0                  # parameter and buffer bytes
    rss_before: int = 0
    rss_after: int = 0
    load_ms: float = 0.0


class ModelUnloaded(Struct, tag_field="op", tag="w_unloaded"):
    worker_id: int
    key: str
    rss_before: int = 0
    rss_after: int = 0              # after the collector ran and freed memory went back (malloc_trim)


class WorkerFailed(Struct, tag_field="op", tag="w_failed"):
    worker_id: int
    model: str
    error: str


class Batch(Struct, tag_field="op", tag="w_batch"):
    batch_id: int
    model: str
    version: str
    rows: int
    block: int                # input-arena block holding every input of the batch
    inputs: list[BlockTensor]
    deadline: float = 0.0     # CLOCK_MONOTONIC seconds (system-wide): past it, nobody waits - skip
    release: list[int] = []   # output blocks the broker is done with (saves a Release message)
    splits: list[int] = []    # rows of each request, in order: where outputs may be cut into parts


class Done(Struct, tag_field="op", tag="w_done"):
    batch_id: int
    outputs: list[BlockTensor] = []
    block: Optional[int] = None     # output-arena block the broker must release
    error: Optional[ErrorBody] = None
    compute_us: int = 0
    # A batch whose outputs cannot fit the output arena as one block is answered in parts, at
    # request boundaries: this part answers requests first..first+count-1 (count 0: through
    # the end); more parts follow while final is False. The defaults: the whole batch at once.
    first: int = 0
    count: int = 0
    final: bool = True


class Release(Struct, tag_field="op", tag="w_release"):
    blocks: list[int]


class Stop(Struct, tag_field="op", tag="w_stop"):
    pass


class Heartbeat(Struct, tag_field="op", tag="w_beat"):
    """Sent every heartbeat_s by a thread of the worker that does not depend on its serving
    loop, on the worker's control socket (identity: the worker's + b"~ctl")."""
    worker_id: int
    pid: int
    sent: float                      # CLOCK_MONOTONIC seconds (system-wide)
    rss: int                         # bytes
    cpu_s: float                     # user + system seconds since the process started
    fds: int
    threads: int
    batches: int                     # batches completed since start
    batch_id: Optional[int] = None   # the batch computing now, if any ...
    batch_since: float = 0.0         # ... and since when (CLOCK_MONOTONIC)
    cuda_allocated: int = 0          # bytes, GPU workers only
    cuda_reserved: int = 0


class SnapshotRequest(Struct, tag_field="op", tag="w_snap"):
    """Broker -> worker control socket: report memory figures. The first request starts
    tracemalloc (it costs nothing until then); later ones report growth since the first."""
    snapshot_id: int
    top: int = 25


class LineGrowth(Struct):
    where: str            # "file:line"
    size_diff: int        # bytes allocated there since tracing started
    count_diff: int


class WorkerSnapshot(Struct, tag_field="op", tag="w_snapped"):
    snapshot_id: int
    worker_id: int
    tracing_since: float                      # CLOCK_MONOTONIC when tracemalloc started
    traced_bytes: int = 0
    growth: list[LineGrowth] = []             # top growth by line since tracing started
    cuda: dict[str, Any] = {}                 # torch.cuda.memory_snapshot() summary on GPU


ToWorker = Union[LoadModels, Batch, Release, Stop, SnapshotRequest, LoadModel, UnloadModel]
FromWorker = Union[WorkerHello, WorkerReady, WorkerFailed, Done, Heartbeat, WorkerSnapshot, LoaderHello, ModelLoaded,
                   ModelUnloaded]

encoder = msgspec.msgpack.Encoder()
encode = encoder.encode
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
envelope_decoder = msgspec.msgpack.Decoder(Envelope)
to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)
# RecursionError: msgspec recurses once per nesting level, so ~1,000 nested maps (3 KB) exhaust the stack
DecodeError = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


def model_key(name: str, version: str) -> str:
    """How workers and the broker name one loaded version: "name:version"."""
    return f"{name}:{version}"


def split_model_key(key: str) -> tuple[str, str]:
    name, version = key.split(":", 1)
    return name, version


def nbytes_of(dtype: str, shape: list[int]) -> int:
    n = DTYPE_SIZES[dtype]
    for dim in shape:
        n *= dim
    return n
