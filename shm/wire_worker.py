"""The wire contract between the broker and its workers (internal; docs/PROTOCOL.md section 13).

Imported through tgw.shm.wire like every other message.
"""
from __future__ import annotations

from typing import Any, Optional

from .wire_base import CudaIpc, ErrorBody, IOSpec, Struct
from .wire_generate import GeneratorSpec, GenSeq
from .wire_sequence import SeqStep, SequenceSpec

# ---- broker <-> worker -----------------------------------------------------------------------

class ReplayBatch(Struct):
    """One batch the model served lately, to warm a new version with (broker/models/replay.py)."""
    rows: int
    shapes: list[list[int]]          # each declared input's shape without the batch dim, in declared order
    payload: list[bytes] = []        # each input's bytes, as the ring held them; []: zeros (warmup.replay_payloads off)


class Replay(Struct):
    """A sample of a model's recent batches: a version loaded while the model serves runs each
    until its compute p99 settles (workers/replay.py), bounded by max_s."""
    batches: list[ReplayBatch]
    max_s: float = 30.0


class ReplayReport(Struct):
    """What a replay warm-up did (ModelLoaded.replay)."""
    rounds: int = 0
    covered: list[ReplayBatch] = []  # the batches replayed (rows and shapes; no payloads)
    p99_ms: list[float] = []         # each round's compute p99 (with under 100 batches: its slowest)
    settled: bool = False            # False: max_s ran out first (or every batch raised)
    seconds: float = 0.0
    payloads: bool = False           # the requests' own bytes were replayed, not zeros
    failed: list[str] = []           # batches that raised (left out of later rounds), bounded


class ModelSpec(Struct, gc=True):   # tracked: a stage's setup reads its options (copied, but user code), and loads are rare
    name: str
    version: str
    path: str
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    warmup_batch_sizes: list[int] = []
    sha256: Optional[str] = None   # checked by the worker on the very bytes it loads
    format: str = "torchscript"    # torchscript, export, aoti: checked again on those bytes; stage: `handler`
    handler: str = ""              # a stage's class: "/abs/file.py:Class" or "module:Class"
    device: str = ""               # a stage's declared device kind: cpu or cuda
    options: dict[str, Any] = {}   # a stage's `options:`, given to its setup(context)
    max_batch_size: int = 0        # the most rows the broker batches: a program's batch range must allow 1..it
    batched: bool = True           # False: the model takes no batch dim (max_batch_size 0): one request, squeezed
    replay: Optional[Replay] = None   # run-time loads of a model that served: warm up on its recent batches too
    # a stage's config `warmup_inputs`: examples it is called with once at load (workers/stage_proof.py)
    warmup_inputs: list[dict[str, Any]] = []
    generator: Optional[GeneratorSpec] = None   # a generator's (docs/GENERATION.md): its state, slots, limits
    sequence: Optional[SequenceSpec] = None     # a sequence model's (docs/SEQUENCES.md): its state, controls, slots


class BlockTensor(Struct):
    """A tensor laid in a ring arena: `nbytes` bytes at byte `offset` of the arena."""
    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int
    # a `bytes` output's rows: where each begins, relative to `offset`, and the end (rows + 1)
    cuts: list[int] = []


class WorkerHello(Struct, tag_field="op", tag="w_hello"):
    v: int
    worker_id: int
    pid: int
    device_uuid: str = ""           # a GPU worker's device UUID (CUDA tensors by IPC handle go to it)
    device_memory: int = 0          # a GPU worker's device memory, bytes (workers.max_model_memory shares)
    host_memory: str = ""           # how its ring is page-locked in effect: register, staging, pageable; "" on the CPU


class LoadModels(Struct, tag_field="op", tag="w_load"):
    """The broker's answer to a hello: the start-up models, which the worker's loader thread
    loads one by one while its serving loop already serves those that are in."""
    models: list[ModelSpec]


class Footprint(Struct):
    """One loaded version's memory on its device as the worker measured it (workers/footprint.py):
    on cuda the allocator's figures, on cpu the process's RSS."""
    weights: int = 0                # growth at load, before warm-up
    activation_peak: int = 0        # the largest of by_batch
    by_batch: dict[int, int] = {}   # warm-up batch size -> peak above what was allocated before it
    measured_on: str = ""           # cuda or cpu ("": not measured)

    @property
    def total(self) -> int:
        return self.weights + self.activation_peak


class WorkerReady(Struct, tag_field="op", tag="w_ready"):
    """Every start-up model is in (each was told by its ModelLoaded as it came): sent by the
    loader thread, after its LoaderHello and those ModelLoaded."""
    worker_id: int
    models: list[str]
    sizes: dict[str, int] = {}      # model key -> parameter and buffer bytes
    footprints: dict[str, Footprint] = {}   # model key -> measured at its load and warm-up


# Runtime loads go over the worker's loader socket (identity: the worker's + b"~load"), served
# by a thread of its own so batches keep running while a model loads.

class LoaderHello(Struct, tag_field="op", tag="w_loader"):
    """The loader thread is connected: the broker may send it loads."""
    worker_id: int


class LoadModel(Struct, tag_field="op", tag="w_load1"):
    spec: ModelSpec


class UnloadModel(Struct, tag_field="op", tag="w_unload"):
    key: str                        # "name:version"; the broker has no batch of it in flight


class LoadPhase(Struct, tag_field="op", tag="w_phase"):
    """The loader thread's word as one load moves on, start-up and run-time loads alike:
    "loading" as it begins, "warming" once the model is built. Its ModelLoaded ends it (at
    start-up, a failure's WorkerFailed does)."""
    worker_id: int
    key: str
    phase: str                      # loading, warming
    seconds: float = 0.0            # since the load began, as the worker measured it


class ModelLoaded(Struct, tag_field="op", tag="w_loaded"):
    """A load done. A start-up model's (`startup`) is sent as soon as that model is warmed up:
    it serves from then on, while the worker's other start-up models still load."""
    worker_id: int
    key: str
    error: Optional[str] = None     # None: loaded and warmed up, serving from now on
    reason: str = ""                # with an error: file, checksum, format, load, warmup, out_of_memory
    bytes: int = 0                  # parameter and buffer bytes
    rss_before: int = 0
    rss_after: int = 0
    load_ms: float = 0.0            # the whole load, warm-up included
    warm_ms: float = 0.0            # of load_ms, the warm-up's (its replay included)
    startup: bool = False           # one of the models its LoadModels named (WorkerReady follows the last)
    footprint: Optional[Footprint] = None   # measured at load and warm-up (None: failed, or an old worker)
    replay: Optional[ReplayReport] = None   # the replay warm-up's figures (None: the spec had no replay)
    slots: int = 0                  # a generator's or sequence model's state slots (sequences it holds at once); 0 otherwise


class ModelUnloaded(Struct, tag_field="op", tag="w_unloaded"):
    worker_id: int
    key: str
    rss_before: int = 0
    rss_after: int = 0              # after the collector ran and freed memory went back (malloc_trim)


class WorkerFailed(Struct, tag_field="op", tag="w_failed"):
    """A preload (the main thread's) or a start-up model (the loader thread's) failed: the
    worker serves no more, and the broker stops it."""
    worker_id: int
    model: str
    error: str


class WorkerFault(Struct, tag_field="op", tag="w_fault"):
    """A sticky CUDA error (illegal memory access, device-side assert, ...): this worker's CUDA
    context is broken, so it answers nothing more and exits; the broker retries what it held."""
    worker_id: int
    batch_id: Optional[int]         # the batch whose work raised it (None: outside any batch)
    error: str                      # torch's message, bounded
    kind: str = ""                  # the marker matched (workers/cuda_faults.py STICKY)


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
    traces: list[str] = []    # each request's W3C traceparent ("" if none), in order; [] when none has one
    ids: list[int] = []       # each request's id as its caller sent it, in order (the worker's failure lines)
    # CUDA tensors by IPC handle (docs/PROTOCOL.md 5.10), per request in order; [] when none:
    cuda_inputs: list[list[CudaIpc]] = []        # its inputs in declared order (then `inputs` carry no bytes)
    cuda_outputs: list[dict[str, CudaIpc]] = []  # output name -> the caller's buffer to write its rows into
    # a generator's admission batch (shm/wire_generate.py): each request as a sequence, in order;
    # the worker answers the batch with a Done without outputs once it has taken them in
    sequences: list[GenSeq] = []
    # a sequence model's batch (shm/wire_sequence.py): each request's slot and flags, in order
    steps: list[SeqStep] = []


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
    # requests (by index in the batch, as `first`) a stage failed on their own: each answered
    # with its error, the others with their rows (which the outputs still carry)
    failed: dict[int, ErrorBody] = {}
    # requests (by index in the batch as sent) the worker took out before launching it, at the
    # broker's Withdraw: the outputs carry no rows of theirs, and `first`, `count` and `failed`
    # count the requests that were kept. On every part of such a batch; [] otherwise.
    withdrawn: list[int] = []


class Release(Struct, tag_field="op", tag="w_release"):
    blocks: list[int]


class Withdraw(Struct, tag_field="op", tag="w_withdraw"):
    """Broker -> worker: nobody waits for these requests of a batch (indices in the batch as
    sent) any more. A worker that has not launched the batch takes them out (Done.withdrawn);
    for a batch already launched or done it is ignored."""
    batch_id: int
    requests: list[int]


class Stop(Struct, tag_field="op", tag="w_stop"):
    pass


class GpuReading(Struct):
    """A GPU worker's device as NVML reports it, read by the worker (by its device's UUID) at a
    heartbeat: a figure the device does not report is None."""
    memory_used: Optional[int] = None      # bytes of device memory in use, by every process on the GPU
    memory_total: Optional[int] = None     # bytes of device memory
    utilization: Optional[float] = None    # share of NVML's last sample period in which a kernel ran (0-1)
    temperature_c: Optional[float] = None  # core temperature, degrees Celsius
    power_w: Optional[float] = None        # board power draw, watts


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
    output_used: int = 0             # bytes of its output arena in unreleased blocks
    gpu: Optional[GpuReading] = None  # GPU workers where NVML answers; None on the CPU
    gpu_ooms: int = 0                # CUDA out-of-memory errors met since start, recovered ones included
    rss_anon: int = 0                # bytes of anonymous RSS: without the ring's shared pages and mapped files
    gc: dict[str, Any] = {}          # its collection pauses and freeze (shm/gc_watch.py GcWatch.as_dict)


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
