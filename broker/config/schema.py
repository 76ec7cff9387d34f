"""The YAML configuration's schema (pydantic): every key, its type, range and default.

Here the workers, the server, tenants, the operational sections (supervision, warm-up, the HTTP
and gRPC faces, observability) and the whole Config; the models' part is schema_models.py, the
pipelines' pipelines.py, every section's base strict.py. Loading, the problem report and file
checks live in load.py, which re-exports these.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import Field, PrivateAttr, field_validator, model_validator

from tgw.shm.paths import ADDRESS_FORMS, address_problem

from .pipelines import PipelineDecl, PipelineError, StepDecl, problems as pipeline_problems  # noqa: F401
from .schema_models import BreakerDecl, CacheDecl, GeneratorDecl, ModelDecl, StateDecl, TensorDecl, VersionDecl  # noqa: F401,E501 - the schema's names
from .strict import Strict


Device = Annotated[str, Field(pattern=r"^(cpu|cuda:\d+)$")]


class WorkersDecl(Strict):
    devices: Union[Literal["auto"], Annotated[list[Device], Field(min_length=1)]] = "auto"
    threads_per_worker: Annotated[int, Field(ge=1, le=256)] = 1
    pin_cpus: bool = False
    # MiB per worker, or "auto": sized from the models at load (broker/config/arenas.py has the rule)
    input_arena_mb: Union[Literal["auto"], int] = "auto"
    output_arena_mb: Union[Literal["auto"], int] = "auto"
    start_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    # imported (module name) or torch.ops.load_library-ed (path ending .so) by each worker before
    # its models load: how a deployment registers the custom ops its models call
    preload: list[Annotated[str, Field(min_length=1)]] = []
    # how a CUDA worker page-locks its ring for copies to and from the GPU (workers/device_io.py):
    # register the ring (no host copy), a pinned staging buffer per batch, or pageable (a baseline)
    cuda_host_memory: Literal["register", "staging", "pageable"] = "register"
    # each worker's budget for loaded models: bytes (int) or share of its device's memory (float in (0, 1])
    max_model_memory: Optional[Union[int, float]] = None
    # where on-demand versions load (docs/MEMORY.md): spread = the worker with the most budget left;
    # pack = the fullest one they still fit on, so whole devices stay free
    placement: Literal["spread", "pack"] = "spread"
    # CPU workers that serve only stages (device cpu); 0: cpu stages go on the CPU workers with the models
    stage_workers: Annotated[int, Field(ge=0, le=64)] = 0
    # how a worker's serving loop and the broker exchange batches (shm/doorbell.py): socket = a
    # socketpair per worker life; zmq = the back socket, as the heartbeats and loads always do
    doorbell: Literal["socket", "zmq"] = "socket"
    # the arenas' sizes in bytes once resolved (arenas.resolve, called by parse_config)
    _input_bytes: Optional[int] = PrivateAttr(default=None)
    _output_bytes: Optional[int] = PrivateAttr(default=None)

    @field_validator("input_arena_mb", "output_arena_mb", mode="plain")
    @classmethod
    def _arena_mb(cls, v: object) -> Union[str, int]:
        if v == "auto" or (type(v) is int and 1 <= v <= 65536):
            return v
        raise ValueError(f"must be auto (sized from the models) or a whole number of MiB 1..65536, got {v!r}")

    @field_validator("max_model_memory", mode="plain")
    @classmethod
    def _model_memory(cls, v: object) -> Union[None, int, float]:
        if v is None or (type(v) is int and v >= 1 << 20) or (type(v) is float and 0 < v <= 1):
            return v
        raise ValueError(f"must be bytes (a whole number >= 1048576) or a share of device memory in (0, 1], got {v!r}")

    def _arena(self, key: str, resolved: Optional[int]) -> int:
        if resolved is not None:
            return resolved
        mb = getattr(self, key)
        if mb == "auto":
            raise RuntimeError(f"workers.{key} is auto and not resolved yet: load the config with "
                               "parse_config (or size it with tgw.broker.config.arenas.resolve)")
        return mb << 20

    @property
    def input_bytes(self) -> int:
        """Each worker's input arena: the most one batch (and so one request) may occupy."""
        return self._arena("input_arena_mb", self._input_bytes)

    @property
    def output_bytes(self) -> int:
        return self._arena("output_arena_mb", self._output_bytes)


class ServerDecl(Strict):
    """The client-facing socket and the limits every caller is held to (checked before any
    allocation a request would cause; docs/SECURITY.md's threat model says what each one defends)."""
    address: Optional[str] = None  # default: $TGW_ADDRESS, ipc://$XDG_RUNTIME_DIR/tgw, /run/tgw, /tmp/tgw-<uid>
    # decoded tensor bytes of one request (from the declared shapes, before any decompression);
    # also bounds each frame on the wire (ZMQ_MAXMSGSIZE), so a larger one is never received whole
    max_request_bytes: Annotated[int, Field(ge=1024)] = 64 << 20
    max_header_bytes: Annotated[int, Field(ge=256, le=16 << 20)] = 64 << 10
    max_tensors_per_request: Annotated[int, Field(ge=1, le=4096)] = 64
    max_dims: Annotated[int, Field(ge=1, le=64)] = 16              # per tensor, batch dim included
    max_elements: Annotated[int, Field(ge=1)] = 1 << 28            # per tensor
    max_element_bytes: Annotated[int, Field(ge=1)] = 16 << 20      # per element of a bytes tensor
    # elements of one bytes tensor: the broker's loop checks each one's length (about 0.2 us each)
    max_bytes_elements: Annotated[int, Field(ge=1)] = 65536
    max_inflight_per_client: Annotated[int, Field(ge=1)] = 1024    # admitted, not yet answered
    max_clients: Annotated[int, Field(ge=1)] = 1000                # connected callers
    client_queue_bytes: Annotated[int, Field(ge=1 << 16)] = 64 << 20   # replies waiting for one slow reader
    client_queue_messages: Annotated[int, Field(ge=1)] = 1000
    max_inflight_batches_per_worker: Annotated[int, Field(ge=1, le=8)] = 2
    socket_dir_mode: Annotated[str, Field(pattern=r"^0?[0-7]{3}$")] = "0750"   # a socket folder tgw creates
    socket_group: Optional[Annotated[str, Field(min_length=1)]] = None   # may use the front socket
    auth_token_file: Optional[str] = None         # shared token every native request must carry
    curve_secret_key_file: Optional[str] = None   # ZeroMQ CURVE key pair (tgw-broker keygen)
    # shared-memory regions (docs/PROTOCOL.md 5.9): the bytes one client process may register, in all
    max_region_bytes: Annotated[int, Field(ge=0)] = 1 << 30
    # on the first SIGTERM/SIGINT: seconds of reporting not ready while still serving (so
    # balancers stop sending) before the drain; 0: drain at once
    drain_notice_s: Annotated[float, Field(ge=0, le=3600)] = 0.0
    # Triton's repository load with a config override and files (file:<path>) on the HTTP and gRPC
    # faces: written under <first model root>/uploads/ and served; needs auth_token_file
    allow_model_uploads: bool = False
    # processes that serve the HTTP and gRPC faces' ports (SO_REUSEPORT) and parse requests off the
    # broker's loop (broker/fronts/); None: chosen from the cores (0 on small boxes: one loop does all)
    front_processes: Optional[Annotated[int, Field(ge=0, le=64)]] = None
    # gc.freeze() after start-up and warm-up in the broker, fronts and workers: no full collection
    # walks the long-lived objects during load (status shows the longest pause either way)
    gc_freeze: bool = True

    @field_validator("address")
    @classmethod
    def _address(cls, v: Optional[str]) -> Optional[str]:
        problem = address_problem(v, bind=True) if v is not None else None
        if problem:
            raise ValueError(f"address {v!r}: {problem}; expected {ADDRESS_FORMS}")
        return v

    @field_validator("socket_dir_mode")
    @classmethod
    def _private_dir(cls, v: str) -> str:
        if int(v, 8) & 0o022:
            raise ValueError(f"socket_dir_mode {v} lets other users replace the socket; "
                             "group and others may not write (e.g. 0750)")
        return v

    @model_validator(mode="after")
    def _uploads_need_the_token(self) -> "ServerDecl":
        if self.allow_model_uploads and not self.auth_token_file:
            raise ValueError("allow_model_uploads needs server.auth_token_file: a load with files runs what "
                             "it is sent, so only a caller with the token may send it")
        return self

    @model_validator(mode="after")
    def _tcp_is_encrypted(self) -> "ServerDecl":
        if self.address and self.address.startswith("tcp://") and not self.curve_secret_key_file:
            raise ValueError("a tcp:// address needs server.curve_secret_key_file (a ZeroMQ CURVE key "
                             "pair: `tgw-broker keygen DIR` writes one)")
        return self

    @property
    def dir_mode(self) -> int:
        return int(self.socket_dir_mode, 8)


TenantName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]


class TenantDecl(Strict):
    """One caller's quota: a token bucket of `rate` requests/s holding at most `burst`, and at
    most `max_inflight` requests admitted and not yet answered."""
    rate: Annotated[float, Field(gt=0)]
    burst: Annotated[int, Field(ge=1)]
    max_inflight: Optional[Annotated[int, Field(ge=1)]] = None


class CrashLoopDecl(Strict):
    deaths: Annotated[int, Field(ge=2)] = 5        # this many deaths of one worker ...
    window_s: Annotated[float, Field(gt=0)] = 60.0  # ... within this window is a crash loop:
    backoff_s: Annotated[float, Field(gt=0)] = 30.0  # its models are unavailable on it this long


class CudaFaultDecl(Strict):
    """A sticky CUDA error poisons its worker (replaced at once, its requests retried); this many
    on one GPU within the window take that GPU out of service (no worker on it) for a while."""
    faults: Annotated[int, Field(ge=1)] = 3
    window_s: Annotated[float, Field(gt=0)] = 600.0
    out_of_service_s: Annotated[float, Field(gt=0)] = 600.0   # then one worker is started again as a probe


class LeakDecl(Strict):
    """When a worker's memory counts as leaking: a snapshot, then a graceful recycle."""
    window_s: Annotated[float, Field(gt=0)] = 120.0       # RSS history judged
    min_samples: Annotated[int, Field(ge=3)] = 20          # beats in the window before judging a slope
    mib_per_min: Optional[Annotated[float, Field(gt=0)]] = None          # sustained rise per minute
    mib_per_1k_batches: Optional[Annotated[float, Field(gt=0)]] = None   # ... or per 1,000 batches
    rss_ceiling_mb: Optional[Annotated[int, Field(ge=1)]] = None         # RSS above this, whatever the slope
    trace_s: Annotated[float, Field(gt=0)] = 10.0          # tracemalloc runs this long before the snapshot
    recycle: bool = True                                    # replace the worker after the snapshot


class FragmentationDecl(Strict):
    """After an unload, memory a worker keeps beyond what its models need (cuda: reserved less
    allocated; cpu: anonymous RSS above the fresh worker's plus its models' footprints): past
    both bounds set, for `beats` heartbeats in a row, a graceful recycle (docs/MEMORY.md)."""
    max_mb: Optional[Annotated[float, Field(ge=0)]] = 1024.0   # MiB kept beyond need ...
    max_share: Optional[Annotated[float, Field(ge=0, le=1)]] = 0.25   # ... and this share of what it holds
    beats: Annotated[int, Field(ge=1)] = 3                    # in a row: a batch's passing peak is no waste
    recycle: bool = True                                      # false: logged only

    @property
    def enabled(self) -> bool:
        return self.max_mb is not None or self.max_share is not None


class SupervisorDecl(Strict):
    heartbeat_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    hang_timeout_s: Annotated[float, Field(gt=0)] = 10.0      # silent this long: killed and replaced
    batch_timeout_s: Annotated[float, Field(gt=0)] = 60.0     # a batch computing longer than
    batch_timeout_factor: Annotated[float, Field(ge=1)] = 20.0  # max(this, factor x its predicted time)
    crash_loop: CrashLoopDecl = CrashLoopDecl()
    cuda_faults: CudaFaultDecl = CudaFaultDecl()
    leak: LeakDecl = LeakDecl()
    fragmentation: FragmentationDecl = FragmentationDecl()
    snapshot_dir: Optional[str] = None   # default $STATE_DIRECTORY/snapshots, else <runtime dir>/snapshots
    shutdown_grace_s: Annotated[float, Field(gt=0, le=3600)] = 30.0

    @model_validator(mode="after")
    def _beats_fit(self) -> "SupervisorDecl":
        if self.hang_timeout_s < 2 * self.heartbeat_s:
            raise ValueError(f"hang_timeout_s ({self.hang_timeout_s}) must be at least twice heartbeat_s "
                             f"({self.heartbeat_s}): one late beat is not a hang")
        return self


class WarmupDecl(Strict):
    """Replay warm-up (docs/OPERATIONS.md#warm-up): a version loaded while its model serves runs
    the model's recent batches until its compute p99 settles, before it takes traffic."""
    replay: bool = True              # false: only models[].warmup_batch_sizes, as at start-up
    # keep the requests' bytes too, not only their shapes: real data held in the broker and sent
    # to workers that load a new version - a privacy choice, so off
    replay_payloads: bool = False
    samples: Annotated[int, Field(ge=1, le=1024)] = 32     # distinct (shape, batch rows) kept per model, newest
    payload_mb: Annotated[int, Field(ge=1, le=1024)] = 16  # with replay_payloads: MiB of bytes kept per model
    max_s: Annotated[float, Field(gt=0)] = 30.0            # then the version is ready, settled or not


class HttpDecl(Strict):
    """The KServe v2 / Open Inference Protocol face, served on the broker's own event loop."""
    host: Annotated[str, Field(min_length=1)] = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000    # 0: any free port (status shows which)
    max_body_bytes: Annotated[int, Field(ge=1024)] = 256 << 20   # JSON tensors are ~10x their binary size
    max_inflight: Annotated[int, Field(ge=1)] = 4096       # HTTP requests admitted and not yet answered
    allow_client_shm: bool = False   # Triton's system/CUDA shared-memory extensions (off, as in Triton now)


class TorchServeDecl(Strict):
    """TorchServe's inference and management APIs on their own ports, over the archives of
    model_store (docs/MIGRATING.md, from TorchServe)."""
    host: Annotated[str, Field(min_length=1)] = "127.0.0.1"
    inference_port: Annotated[int, Field(ge=0, le=65535)] = 8080    # 0: any free port (status shows which)
    management_port: Annotated[int, Field(ge=0, le=65535)] = 8081
    # archives served at start, as TorchServe's --models: "all", "NAME=FILE.mar" or "FILE.mar"
    models: list[Annotated[str, Field(min_length=1)]] = []
    device: Literal["cpu", "cuda"] = "cpu"     # where the handlers run (cuda: on the GPU workers)
    unpack_dir: Optional[str] = None           # where archives are unpacked; None: model_store/.tgw-unpacked
    max_body_bytes: Annotated[int, Field(ge=1024)] = 64 << 20   # TorchServe's max_request_size is 6.5 MB


class JobsDecl(Strict):
    """Polled jobs (docs/JOBS.md): requests answered at once with an id, their results kept in the
    broker's memory until fetched and then for keep_s; every bound answers a clear error."""
    max_jobs: Annotated[int, Field(ge=1)] = 10_000          # jobs held, running and kept; more: OVERLOADED at submit
    max_result_bytes: Annotated[int, Field(ge=1024)] = 256 << 20   # bytes of outputs held by all jobs together
    keep_s: Annotated[float, Field(gt=0)] = 600.0            # a result is kept this long after its job ends
    max_wait_ms: Annotated[int, Field(ge=0)] = 30_000       # a long poll's wait_ms is capped at this


class GrpcDecl(Strict):
    """The KServe v2 gRPC face (inference.GRPCInferenceService, grpc.health.v1, reflection).
    Message sizes are bounded by server.max_request_bytes."""
    host: Annotated[str, Field(min_length=1)] = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8001    # 0: any free port (status shows which)
    max_inflight: Annotated[int, Field(ge=1)] = 4096       # gRPC inference requests admitted and not yet answered
    tls_cert_file: Optional[Annotated[str, Field(min_length=1)]] = None   # PEM chain; relative: to the config file
    tls_key_file: Optional[Annotated[str, Field(min_length=1)]] = None    # PEM private key, with tls_cert_file
    tls_client_ca_file: Optional[Annotated[str, Field(min_length=1)]] = None   # set: callers need certificates it signed
    allow_client_shm: bool = False   # Triton's system/CUDA shared-memory extensions (off, as in Triton now)

    @model_validator(mode="after")
    def _tls_pair(self) -> "GrpcDecl":
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("grpc.tls_cert_file and grpc.tls_key_file go together: set both for TLS, or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("grpc.tls_client_ca_file needs TLS: set grpc.tls_cert_file and grpc.tls_key_file too")
        return self


def _importable(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:   # a parent package is missing
        return False


class TracingDecl(Strict):
    """OpenTelemetry spans: one per request in the broker (with its phases), one per batch in
    each worker. Needs opentelemetry-sdk (`pip install tgw[tracing]`)."""
    exporter: Literal["console", "file", "otlp"]   # stdout; one JSON span per line in `path`; OTLP
    path: Optional[Annotated[str, Field(min_length=1)]] = None   # file: relative to the config file
    endpoint: Optional[Annotated[str, Field(min_length=1)]] = None   # otlp: else $OTEL_EXPORTER_OTLP_ENDPOINT
    sample_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0   # traces started here; a caller's flag wins
    service_name: Annotated[str, Field(min_length=1)] = "tgw"

    @model_validator(mode="after")
    def _usable(self) -> "TracingDecl":
        if (self.exporter == "file") != (self.path is not None):
            raise ValueError("path is required with exporter file, and only with it")
        if self.endpoint is not None and self.exporter != "otlp":
            raise ValueError("endpoint goes with exporter otlp only")
        if not _importable("opentelemetry.sdk.trace"):
            raise ValueError("tracing needs the OpenTelemetry SDK, which is not installed: pip install 'tgw[tracing]' "
                             "(or remove observability.tracing)")
        if self.exporter == "otlp" and not _importable("opentelemetry.exporter.otlp"):
            raise ValueError("exporter otlp needs an OTLP exporter, which is not installed: pip install "
                             "opentelemetry-exporter-otlp (or use exporter file or console)")
        return self


class ObservabilityDecl(Strict):
    """Logs and traces beyond the defaults."""
    slow_request_ms: Optional[Annotated[float, Field(gt=0)]] = None   # log requests slower than this, with phases
    tracing: Optional[TracingDecl] = None   # OpenTelemetry spans; None: off, and opentelemetry is never imported


class Config(Strict):
    # folders model files must lie in; relative: to the config file's folder; empty: that folder
    model_roots: list[Annotated[str, Field(min_length=1)]] = []
    # Triton model repositories served beside `models` (broker/config/repository.py, docs/MIGRATING.md):
    # a folder or a list of them; relative: to the config file's folder; `start --model-repository` sets it
    model_repository: Union[None, Annotated[str, Field(min_length=1)],
                            Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]] = None
    server: ServerDecl = ServerDecl()
    workers: WorkersDecl = WorkersDecl()
    supervisor: SupervisorDecl = SupervisorDecl()
    warmup: WarmupDecl = WarmupDecl()              # replay warm-up of versions loaded while serving
    http: Optional[HttpDecl] = None                # the KServe v2 HTTP face; None: off
    grpc: Optional[GrpcDecl] = None                # the KServe v2 gRPC face; None: off
    observability: ObservabilityDecl = ObservabilityDecl()
    jobs: JobsDecl = JobsDecl()                    # polled jobs: bounds and how long results are kept
    # at least one (a model_repository's are added to them), unless model_store serves archives
    models: list[ModelDecl] = []
    model_store: Optional[str] = None              # a folder of TorchServe .mar archives (torchserve: serves them)
    torchserve: Optional[TorchServeDecl] = None    # TorchServe's APIs; None: off (on with model_store)
    tenants: dict[TenantName, TenantDecl] = {}
    default_tenant: Optional[TenantName] = None   # whose limits a request naming no known tenant gets
    require_tenant: bool = False                   # then such a request is UNAUTHENTICATED instead
    pipelines: list[PipelineDecl] = []             # served names that are DAGs of steps (docs/PIPELINES.md)
    _http_port: Optional[int] = PrivateAttr(default=None)   # `start --http-port`: a reload keeps it
    _grpc_port: Optional[int] = PrivateAttr(default=None)   # `start --grpc-port`: a reload keeps it
    # models served beside the file's (TorchServe archives) and their roots: a reload keeps them
    _extra_models: list = PrivateAttr(default_factory=list)
    _extra_roots: list = PrivateAttr(default_factory=list)
    _repository_flag: Optional[list[str]] = PrivateAttr(default=None)   # `start --model-repository`: a reload keeps it
    # what the repository's files ask that tgw does not honour, one line per model (logged at start)
    _repository_warnings: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _references(self) -> "Config":
        if self.torchserve is not None and self.torchserve.models and self.model_store is None:
            raise ValueError("torchserve.models names archives of model_store, which is not set")
        if not self.models and self.model_store is None:
            raise ValueError("models: at least one model is required (or a TorchServe model_store whose archives "
                             "torchserve.models names)")
        if self.default_tenant is not None and self.default_tenant not in self.tenants:
            raise ValueError(f"default_tenant {self.default_tenant!r} is not one of tenants {sorted(self.tenants)}")
        if self.require_tenant and not self.tenants:
            raise ValueError("require_tenant needs at least one entry in tenants")
        if self.warmup.max_s >= self.workers.start_timeout_s:
            raise ValueError(f"warmup.max_s ({self.warmup.max_s:g}) must be less than workers.start_timeout_s "
                             f"({self.workers.start_timeout_s:g}): a load, its warm-up included, gets that long")
        names = {m.name: m for m in self.models}
        for m in self.models:
            fallback = m.breaker.fallback if m.breaker else None
            if fallback is None or fallback == m.name:
                continue
            if fallback not in names:
                raise ValueError(f"model {m.name!r}: breaker.fallback {fallback!r} is not a configured model")
            if names[fallback].signature() != m.signature():
                raise ValueError(f"model {m.name!r}: breaker.fallback {fallback!r} declares different inputs or "
                                 "outputs; a fallback must take and return exactly the same tensors")
        found = pipeline_problems(self.pipelines, self.models)
        if found:   # each reported with its own key path (load._pydantic_problems)
            raise PipelineError(found)
        return self

    def model(self, name: str) -> ModelDecl:
        return next(m for m in self.models if m.name == name)
