"""The models the broker serves and the validation of request headers against them.

Pure bookkeeping and checks, no I/O: a request that leaves `validate` is known to match its
model's declared inputs exactly, so workers never see malformed tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tgw.shm.errors import Code, fail
from tgw.shm.wire import COMPRESSIONS, Infer, IOSpec, ModelInfo, ModelSpec, nbytes_of

from .config import Config, ModelDecl


@dataclass
class ModelEntry:
    decl: ModelDecl
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    input_index: dict[str, int]
    output_names: frozenset[str]
    variable: bool                           # some input has a -1 dim: batch only equal shapes
    versions: frozenset[str]
    # versions some worker has loaded since start: admitted even while that worker restarts
    # (the request waits, bounded by its deadline); health reports the live state instead
    ready_versions: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.decl.name

    def output_bytes(self, rows: int) -> list[int] | None:
        """Bytes of each declared output (the worker writes them all) for `rows` rows; None when
        some output dim is -1, so the size is known only after compute."""
        if any(d == -1 for t in self.outputs for d in t.shape):
            return None
        return [nbytes_of(t.dtype, [rows, *t.shape]) for t in self.outputs]

    def specs(self) -> list[ModelSpec]:
        return [ModelSpec(name=self.name, version=v.version, path=v.path, inputs=self.inputs,
                          outputs=self.outputs, warmup_batch_sizes=list(self.decl.warmup_batch_sizes))
                for v in self.decl.versions]

    def info(self, ready: bool) -> ModelInfo:
        return ModelInfo(name=self.name, versions=[v.version for v in self.decl.versions],
                         default_version=self.decl.default, max_batch_size=self.decl.max_batch_size,
                         inputs=self.inputs, outputs=self.outputs,
                         ready=ready)


@dataclass(slots=True)
class Checked:
    """What validation learned about one request."""
    model: ModelEntry
    version: str
    order: list[int]        # order[k] = index in the request of declared input k
    rows: int
    shape_key: tuple        # non-batch dims of every input, for batching variable shapes
    outputs: list[str]


def _io(t) -> IOSpec:
    return IOSpec(name=t.name, dtype=t.dtype, shape=list(t.shape))


class Registry:
    def __init__(self, cfg: Config):
        self.models: dict[str, ModelEntry] = {}
        for m in cfg.models:
            self.models[m.name] = ModelEntry(
                decl=m, inputs=[_io(t) for t in m.inputs], outputs=[_io(t) for t in m.outputs],
                input_index={t.name: i for i, t in enumerate(m.inputs)},
                output_names=frozenset(t.name for t in m.outputs),
                variable=any(d == -1 for t in m.inputs for d in t.shape),
                versions=frozenset(v.version for v in m.versions))

    def specs(self) -> list[ModelSpec]:
        return [s for m in self.models.values() for s in m.specs()]

    def validate(self, req: Infer, frame_sizes: list[int]) -> Checked:
        model = self.models.get(req.model)
        if model is None:
            raise fail(Code.MODEL_NOT_FOUND, f"no model named {req.model!r}", model=req.model,
                       available=sorted(self.models))
        version = req.version or model.decl.default
        if version not in model.versions:
            raise fail(Code.VERSION_NOT_FOUND, f"model {req.model!r} has no version {version!r}",
                       model=req.model, version=version, available=[v.version for v in model.decl.versions])
        self.check_live(model, version, req)
        order, rows, shape_key = self._check_inputs(model, req, frame_sizes)
        outputs = self._check_outputs(model, req.outputs)
        return Checked(model, version, order, rows, shape_key, outputs)

    @staticmethod
    def check_live(model: ModelEntry, version: str, req: Infer) -> None:
        """What validate() checks that is not fixed by the header's shape fields: readiness, timeout."""
        if version not in model.ready_versions:
            raise fail(Code.MODEL_NOT_READY, f"model {req.model!r} version {version!r} is not loaded yet",
                       model=req.model, version=version)
        if req.timeout_ms is not None and req.timeout_ms < 0:  # the client refuses it too (one rule)
            raise fail(Code.INVALID_ARGUMENT, f"timeout_ms must be >= 0, got {req.timeout_ms}",
                       timeout_ms=req.timeout_ms)

    def _check_inputs(self, model: ModelEntry, req: Infer, frame_sizes: list[int]):
        if len(frame_sizes) != len(req.inputs):
            raise fail(Code.INVALID_ARGUMENT, f"header lists {len(req.inputs)} tensors but "
                       f"{len(frame_sizes)} tensor frames followed it")
        names = [t.name for t in req.inputs]
        expected = [t.name for t in model.inputs]
        if sorted(names) != sorted(expected):
            raise fail(Code.INVALID_ARGUMENT, f"model {model.name!r} takes inputs {expected}, got {names}",
                       expected=expected, got=names)
        order = [names.index(n) for n in expected]
        rows, shape_key = None, []
        max_rows = model.decl.max_batch_size
        for k, decl in enumerate(model.inputs):
            meta = req.inputs[order[k]]
            if meta.dtype != decl.dtype:
                raise fail(Code.INVALID_INPUT_DTYPE, f"input {decl.name!r} must be {decl.dtype}, got {meta.dtype}",
                           input=decl.name, expected=decl.dtype, got=meta.dtype)
            shape = meta.shape
            if len(shape) != len(decl.shape) + 1 or not _dims_match(shape[1:], decl.shape):
                raise fail(Code.INVALID_INPUT_SHAPE, f"input {decl.name!r} must have shape "
                           f"[batch, {', '.join(map(str, decl.shape))}] (-1 = any), got {shape}",
                           input=decl.name, expected=[-1, *decl.shape], got=shape)
            if rows is None:
                rows = shape[0]
            if shape[0] != rows:
                raise fail(Code.INVALID_INPUT_SHAPE, f"inputs disagree on the batch dimension: "
                           f"{decl.name!r} has {shape[0]} rows, others {rows}", input=decl.name)
            if not 1 <= rows <= max_rows:
                raise fail(Code.INVALID_INPUT_SHAPE, f"batch dimension of {decl.name!r} is {rows}; model "
                           f"{model.name!r} takes 1..{max_rows} rows per request",
                           input=decl.name, max_batch_size=max_rows)
            if meta.compression is not None and meta.compression not in COMPRESSIONS:
                raise fail(Code.INVALID_ARGUMENT, f"unknown compression {meta.compression!r} on "
                           f"{decl.name!r}; supported: {list(COMPRESSIONS)}")
            want = nbytes_of(decl.dtype, shape)
            got = frame_sizes[order[k]]
            if meta.compression is None and got != want:
                raise fail(Code.INVALID_ARGUMENT, f"input {decl.name!r}: frame holds {got} bytes but "
                           f"shape {shape} x {decl.dtype} needs {want}", input=decl.name, expected=want, got=got)
            if model.variable:
                shape_key.append(tuple(shape[1:]))
        return order, rows, tuple(shape_key)

    @staticmethod
    def _check_outputs(model: ModelEntry, wanted: list[str] | None) -> list[str]:
        if wanted is None:
            return [t.name for t in model.outputs]
        unknown = [n for n in wanted if n not in model.output_names]
        if unknown or len(set(wanted)) != len(wanted):
            raise fail(Code.INVALID_ARGUMENT, f"requested outputs {wanted}; model {model.name!r} has "
                       f"{sorted(model.output_names)} (each at most once)")
        return list(wanted)


def _dims_match(got: list[int], declared: list[int]) -> bool:
    return all(g >= 0 and (d == -1 or g == d) for g, d in zip(got, declared))
