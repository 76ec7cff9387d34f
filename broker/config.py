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
    model_config = ConfigDict(extra="forbid", frozen=True)


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
        _no_duplicates([v.version for v in self.versions], "versions", "version")
        _no_duplicates([t.name for t in self.inputs], "inputs", "input name")
        _no_duplicates([t.name for t in self.outputs], "outputs", "output name")
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


class Config(Strict):
    server: ServerDecl = ServerDecl()
    workers: WorkersDecl = WorkersDecl()
    models: Annotated[list[ModelDecl], Field(min_length=1)]

    @model_validator(mode="after")
    def _unique_models(self) -> "Config":
        _no_duplicates([m.name for m in self.models], "models", "model name")
        return self

    def model(self, name: str) -> ModelDecl:
        return next(m for m in self.models if m.name == name)


def _no_duplicates(names: list[str], where: str, what: str) -> None:
    seen, dups = set(), []
    for n in names:
        if n in seen:
            dups.append(n)
        seen.add(n)
    if dups:
        raise ValueError(f"duplicate {what} in {where}: {', '.join(sorted(set(dups)))}")


def _format_pydantic(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}: {err.error_count()} problem(s)"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"  {path}: {msg}")
    return "\n".join(lines)


def _check_files(cfg: Config, base_dir: str, source: str) -> Config:
    """Resolve model paths against the config's folder; they must exist and match sha256."""
    problems, models = [], []
    for i, m in enumerate(cfg.models):
        versions = []
        for j, v in enumerate(m.versions):
            path = v.path if os.path.isabs(v.path) else os.path.normpath(os.path.join(base_dir, v.path))
            key = f"models.{i}.versions.{j}"
            if not os.path.isfile(path):
                problems.append(f"  {key}.path: model file not found: {path}")
            elif v.sha256 and file_sha256(path) != v.sha256:
                problems.append(f"  {key}.sha256: does not match {path} (sha256 {file_sha256(path)})")
            versions.append(v.model_copy(update={"path": path}))
        models.append(m.model_copy(update={"versions": versions}))
    if problems:
        raise ConfigError("\n".join([f"invalid config {source}: {len(problems)} problem(s)", *problems]))
    return cfg.model_copy(update={"models": models})


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def parse_config(data: object, base_dir: str, source: str = "<dict>") -> Config:
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_pydantic(err, source)) from None
    return _check_files(cfg, base_dir, source)


def load_config(path: str) -> Config:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: top level must be a mapping with a 'models' key")
    return parse_config(data, os.path.dirname(os.path.abspath(path)), path)
