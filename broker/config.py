"""The YAML configuration, validated completely at start-up (pydantic).

Every problem is reported at once, each line naming its key path (models.0.versions.1.path);
`tgw-broker check-config FILE` runs the same validation without starting anything.
"""
from __future__ import annotations

import hashlib
import os
from typing import Annotated, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tgw.shm.paths import check_ipc_address
from tgw.shm.wire import DTYPE_SIZES


class ConfigError(ValueError):
    """One readable message listing every problem found, each with its key path."""


class Strict(BaseModel):
    # strict: YAML already gives native types, so "32" or true for an int is a mistake to report
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class TensorDecl(Strict):
    name: Annotated[str, Field(min_length=1)]
    dtype: str
    shape: list[int] = Field(description="dims without the batch dimension; -1 = variable")

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {v!r}; one of {', '.join(DTYPE_SIZES)}")
        return v

    @field_validator("shape")
    @classmethod
    def _dims(cls, v: list[int]) -> list[int]:
        if any(d == 0 or d < -1 for d in v):
            raise ValueError(f"dims must be positive or -1 (variable), got {v}")
        return v


class VersionDecl(Strict):
    version: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")]
    path: str
    sha256: Optional[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] = None


class ModelDecl(Strict):
    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]
    versions: Annotated[list[VersionDecl], Field(min_length=1)]
    default_version: Optional[str] = None
    inputs: Annotated[list[TensorDecl], Field(min_length=1)]
    outputs: Annotated[list[TensorDecl], Field(min_length=1)]
    max_batch_size: Annotated[int, Field(ge=1, le=4096)] = 32
    max_queue: Annotated[int, Field(ge=1)] = 1024
    timeout_ms: Annotated[int, Field(ge=1)] = 30000
    warmup_batch_sizes: list[Annotated[int, Field(ge=1)]] = [1]

    @model_validator(mode="after")
    def _consistent(self) -> "ModelDecl":
        if self.default_version is not None and self.default_version not in {v.version for v in self.versions}:
            raise ValueError(f"default_version {self.default_version!r} is not one of the declared versions")
        too_big = [b for b in self.warmup_batch_sizes if b > self.max_batch_size]
        if too_big:
            raise ValueError(f"warmup_batch_sizes {too_big} exceed max_batch_size {self.max_batch_size}")
        return self

    @property
    def default(self) -> str:
        return self.default_version or self.versions[-1].version


Device = Annotated[str, Field(pattern=r"^(cpu|cuda:\d+)$")]


class WorkersDecl(Strict):
    devices: Union[Literal["auto"], Annotated[list[Device], Field(min_length=1)]] = "auto"
    threads_per_worker: Annotated[int, Field(ge=1, le=256)] = 1
    pin_cpus: bool = False
    input_arena_mb: Annotated[int, Field(ge=1, le=65536)] = 64
    output_arena_mb: Annotated[int, Field(ge=1, le=65536)] = 32
    start_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    # imported (module name) or torch.ops.load_library-ed (path ending .so) by each worker before
    # its models load: how a deployment registers the custom ops its models call
    preload: list[Annotated[str, Field(min_length=1)]] = []

    @property
    def input_bytes(self) -> int:
        """Each worker's input arena: the most one batch (and so one request) may occupy."""
        return self.input_arena_mb << 20

    @property
    def output_bytes(self) -> int:
        return self.output_arena_mb << 20


class ServerDecl(Strict):
    address: Optional[str] = None  # default: $TGW_ADDRESS, ipc://$XDG_RUNTIME_DIR/tgw, /run/tgw, /tmp/tgw-<uid>
    max_request_bytes: Annotated[int, Field(ge=1024)] = 64 << 20
    max_inflight_batches_per_worker: Annotated[int, Field(ge=1, le=8)] = 2

    @field_validator("address")
    @classmethod
    def _address(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            if not v.startswith(("ipc://", "tcp://")):
                raise ValueError(f"address must start with ipc:// or tcp://, got {v!r}")
            check_ipc_address(v)
        return v


class CrashLoopDecl(Strict):
    deaths: Annotated[int, Field(ge=2)] = 5        # this many deaths of one worker ...
    window_s: Annotated[float, Field(gt=0)] = 60.0  # ... within this window is a crash loop:
    backoff_s: Annotated[float, Field(gt=0)] = 30.0  # its models are unavailable on it this long


class LeakDecl(Strict):
    """When a worker's memory counts as leaking: a snapshot, then a graceful recycle."""
    window_s: Annotated[float, Field(gt=0)] = 120.0       # RSS history judged
    min_samples: Annotated[int, Field(ge=3)] = 20          # beats in the window before judging a slope
    mib_per_min: Optional[Annotated[float, Field(gt=0)]] = None          # sustained rise per minute
    mib_per_1k_batches: Optional[Annotated[float, Field(gt=0)]] = None   # ... or per 1,000 batches
    rss_ceiling_mb: Optional[Annotated[int, Field(ge=1)]] = None         # RSS above this, whatever the slope
    trace_s: Annotated[float, Field(gt=0)] = 10.0          # tracemalloc runs this long before the snapshot
    recycle: bool = True                                    # replace the worker after the snapshot


class SupervisorDecl(Strict):
    heartbeat_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    hang_timeout_s: Annotated[float, Field(gt=0)] = 10.0      # silent this long: killed and replaced
    batch_timeout_s: Annotated[float, Field(gt=0)] = 60.0     # a batch computing longer than
    batch_timeout_factor: Annotated[float, Field(ge=1)] = 20.0  # max(this, factor x its model's mean)
    crash_loop: CrashLoopDecl = CrashLoopDecl()
    leak: LeakDecl = LeakDecl()
    snapshot_dir: Optional[str] = None   # default $STATE_DIRECTORY/snapshots, else <runtime dir>/snapshots
    shutdown_grace_s: Annotated[float, Field(gt=0, le=3600)] = 30.0

    @model_validator(mode="after")
    def _beats_fit(self) -> "SupervisorDecl":
        if self.hang_timeout_s < 2 * self.heartbeat_s:
            raise ValueError(f"hang_timeout_s ({self.hang_timeout_s}) must be at least twice heartbeat_s "
                             f"({self.heartbeat_s}): one late beat is not a hang")
        return self


class Config(Strict):
    server: ServerDecl = ServerDecl()
    workers: WorkersDecl = WorkersDecl()
    supervisor: SupervisorDecl = SupervisorDecl()
    models: Annotated[list[ModelDecl], Field(min_length=1)]

    def model(self, name: str) -> ModelDecl:
        return next(m for m in self.models if m.name == name)


def _items(data: object, keys: tuple) -> list[tuple[str, object]]:
    """(key path, value) pairs at `keys` in a raw YAML tree; "*" walks a list, an int picks one
    element; whatever is malformed along the way is skipped (it has its own error)."""
    found = [("", data)]
    for key in keys:
        nxt = []
        for path, node in found:
            if isinstance(key, int):
                if isinstance(node, list) and key < len(node):
                    nxt.append((f"{path}.{key}".lstrip("."), node[key]))
            elif key == "*" and isinstance(node, list):
                nxt += [(f"{path}.{i}".lstrip("."), v) for i, v in enumerate(node)]
            elif key != "*" and isinstance(node, dict) and key in node:
                nxt.append((f"{path}.{key}".lstrip("."), node[key]))
        found = nxt
    return found


def _duplicate_problems(data: object) -> list[str]:
    """Checked on the raw tree so they are reported even when other keys fail validation."""
    groups = [(("models", "*", "name"), "model name")]
    for i, _ in enumerate(_items(data, ("models", "*"))):
        groups += [(("models", i, "versions", "*", "version"), "version"),
                   (("models", i, "inputs", "*", "name"), "input name"),
                   (("models", i, "outputs", "*", "name"), "output name")]
    problems = []
    for keys, what in groups:
        seen: dict = {}
        for path, name in _items(data, keys):
            if isinstance(name, str) and name in seen:
                problems.append(f"  {path}: duplicate {what} {name!r} (also at {seen[name]})")
            seen.setdefault(name, path)
    return problems


def _loc(parts: tuple) -> str:
    """Key path of a pydantic error, without the union-member tags pydantic inserts."""
    keep = [str(p) for p in parts if isinstance(p, int) or not any(c in str(p) for c in "[]'(")]
    return ".".join(keep) or "(top level)"


def _pydantic_problems(err: ValidationError) -> list[str]:
    lines = []
    for e in err.errors():
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        line = f"  {_loc(e['loc'])}: {msg}"
        if line not in lines:
            lines.append(line)
    return lines


def _resolve(path: str, base_dir: str) -> str:
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(base_dir, path))


def _file_problems(data: object, base_dir: str) -> list[str]:
    """Model files must exist and match their sha256 (checked on the raw tree, best effort)."""
    problems = []
    for vpath, v in _items(data, ("models", "*", "versions", "*")):
        if not isinstance(v, dict) or not isinstance(v.get("path"), str):
            continue
        path = _resolve(v["path"], base_dir)
        if not os.path.isfile(path):
            problems.append(f"  {vpath}.path: model file not found: {path}")
        elif isinstance(v.get("sha256"), str) and file_sha256(path) != v["sha256"]:
            problems.append(f"  {vpath}.sha256: does not match {path} (sha256 {file_sha256(path)})")
    return problems


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def parse_config(data: object, base_dir: str, source: str = "<dict>") -> Config:
    """Validate everything and report every problem at once; model paths come back absolute."""
    problems, cfg = [], None
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        problems += _pydantic_problems(err)
    problems += _duplicate_problems(data) + _file_problems(data, base_dir)
    if problems:
        raise ConfigError("\n".join([f"invalid config {source}: {len(problems)} problem(s)", *problems]))
    models = [m.model_copy(update={"versions": [v.model_copy(update={"path": _resolve(v.path, base_dir)})
                                                for v in m.versions]}) for m in cfg.models]
    sup = cfg.supervisor
    if sup.snapshot_dir is not None:
        sup = sup.model_copy(update={"snapshot_dir": _resolve(sup.snapshot_dir, base_dir)})
    return cfg.model_copy(update={"models": models, "supervisor": sup})


def load_config(path: str) -> Config:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {path} is not UTF-8 text: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: top level must be a mapping with a 'models' key")
    return parse_config(data, os.path.dirname(os.path.abspath(path)), path)
