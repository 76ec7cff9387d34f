"""The schema's operational sections: supervision, warm-up, the HTTP face, observability.

Split from schema.py (which re-exports them) to keep each module small.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    # strict: YAML already gives native types, so "32" or true for an int is a mistake to report
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


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
