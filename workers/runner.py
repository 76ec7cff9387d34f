"""One loaded model (TorchScript, exported program, AOTInductor package or ONNX model): load, check it
against the declaration, warm up, run a batch, map results to declared outputs."""
from __future__ import annotations

import hashlib
import logging
import os

import torch

from tgw.shm.errors import TgwError
from tgw.shm.model_format import detect
from tgw.shm.wire import IOSpec, ModelSpec, model_key

from .caller_faults import rejected
from .footprint import Gauge
from .model_shapes import from_model, plain, to_model
from .formats import FormatMismatch, Program, aoti_input_problem, load_in_process
from .shape_checks import VARIABLE_SIZE, aoti_edges, check_request_dims, example_size, export_refusals, out_of_range

log = logging.getLogger("tgw.worker")
TORCH_DTYPES = {
    "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "uint16": torch.uint16, "uint32": torch.uint32,
    "uint64": torch.uint64, "float16": torch.float16, "float32": torch.float32,
    "float64": torch.float64, "bfloat16": torch.bfloat16,
}


COPY_CHUNK = 1 << 20


class OutputMismatch(RuntimeError):
    """The model's result does not fit the outputs declared in the config."""


class ChecksumMismatch(ValueError):
    """The model file's bytes do not hash to the sha256 its spec declares."""


class ModelRunner:
    def __init__(self, spec: ModelSpec, device: torch.device, program: Program | None = None):
        """`program`: already loaded (load_verified) by a caller that reads it first (sequence_runner.py)."""
        self.spec, self.device = spec, device
        self.program = program if program is not None else load_verified(spec, device)
        # an exported program's dims are checked against the declaration when it takes it as declared;
        # a program with its own check (ONNX) checks itself
        self.plain = plain(spec)   # the batch path skips model_shapes for the common case
        problems = (export_refusals(spec, self.program) if self.plain else []) + \
            (self.program.check(spec) if self.program.check else [])
        if problems:
            raise self._refused("; ".join(problems))
        self.module, self.nbytes = self.program.call, self.program.nbytes
        self.outputs = spec.outputs
        self.min_batch = 1   # the program's smallest batch (an AOTInductor package's, found at warm-up)
        self.footprint = None   # its measured memory (footprint.warm_measured), once warmed up

    @property
    def key(self) -> str:
        return model_key(self.spec.name, self.spec.version)

    def _refused(self, why: str) -> FormatMismatch:
        return FormatMismatch(f"{self.spec.path} cannot serve {self.key} as declared: {why}")

    def warm_up(self) -> dict[int, int]:
        """Run each warm-up batch size once; also proves the outputs match the declaration. An
        AOTInductor package also runs at the batch and -1 dims' edges (shape_checks.aoti_edges),
        which finds its smallest batch: smaller ones are padded up to it. Returns each size's
        activation peak on the device ({} for a package: its edges are measured as one). The
        smallest size runs once first, unmeasured: a process's first forward pays one-off costs
        (lazy imports, the JIT's profiling runs: 80 MiB of RSS measured here) that no batch needs again."""
        if self.program.fmt == "aoti":
            try:
                self.min_batch = aoti_edges(
                    self.spec, lambda rows, change: self._checked(self._call(self.examples(rows, change)), rows))
            except FormatMismatch as exc:
                raise self._refused(str(exc)) from None
            if self.min_batch > 1:
                log.info("model %s version %s: the AOTInductor package takes batches of %d rows or more; smaller "
                         "batches are padded to %d rows, the padding dropped from the outputs",
                         self.spec.name, self.spec.version, self.min_batch, self.min_batch)
            return {}
        sizes = self.spec.warmup_batch_sizes or [1]
        run = lambda rows: self.run(self.examples(rows), rows)   # noqa: E731
        run(min(sizes))
        return Gauge(self.device).per_batch(sizes, run)

    def examples(self, rows: int, change: tuple[int, int, int] | None = None) -> list[torch.Tensor]:
        """Warm-up inputs: zeros (the least likely to trip a model's own input checks); a -1 dim
        at a size the program allows, or as `change` (input, tensor dim, size) says."""
        # the program's dims line up with the declared ones only for a plain spec (model_shapes.py)
        size = (lambda i, k: example_size(self.program, i, k)) if self.plain else (lambda i, k: VARIABLE_SIZE)
        shapes = [[rows, *(size(i, k) if d == -1 else d for k, d in enumerate(t.shape, 1))]
                  for i, t in enumerate(self.spec.inputs)]
        if change is not None:
            shapes[change[0]][change[1]] = change[2]
        return [torch.zeros(s, dtype=TORCH_DTYPES[t.dtype], device=self.device)
                for s, t in zip(shapes, self.spec.inputs)]

    def run(self, inputs: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
        """Forward one batch; returns the outputs in declared order, on the CPU, C-contiguous."""
        return self.to_host(self.forward(inputs, rows))

    def forward(self, inputs: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
        """Forward one batch; the outputs in declared order, checked, where the model left them
        (on its device)."""
        if self.device.type != "cpu":
            inputs = [t.to(self.device, non_blocking=True) for t in inputs]
        if self.plain:
            check_request_dims(self.spec, self.program, inputs)
        sent = inputs   # before any padding: a rejection's message names these shapes
        short = rows < self.min_batch
        if short:   # run at the program's smallest batch; the padding rows are dropped below
            inputs = padded(inputs, self.min_batch)
        try:
            result = self._call(inputs)
        except Exception as exc:   # the request's shapes or values, when torch says so; else the model's fault
            mistake = self._callers_mistake(exc, [list(t.shape) for t in sent])
            if mistake is None:
                raise
            raise mistake from None
        if not short:
            return self._checked(result, rows)
        return [t[:rows] for t in self._checked(result, self.min_batch)]

    def _callers_mistake(self, exc: Exception, shapes: list[list[int]]) -> TgwError | None:
        if self.program.fmt == "aoti" and isinstance(exc, RuntimeError):   # its own input checks
            problem = aoti_input_problem(exc)
            if problem is not None and problem[1] != 0:
                return out_of_range(f"input {self.spec.inputs[problem[0]].name!r}: {problem[2]}")
        return rejected(self.key, [t.name for t in self.spec.inputs], shapes, exc)

    def _call(self, inputs: list[torch.Tensor]):
        with torch.inference_mode():
            return self.module(*(inputs if self.plain else to_model(self.spec, inputs)))

    def _checked(self, result, rows: int) -> list[torch.Tensor]:
        outs = self._map(result)
        if not self.plain:
            outs = from_model(self.spec, outs)
        for decl, t in zip(self.outputs, outs):
            _check(decl, t, rows)
        return outs

    def to_host(self, outs: list[torch.Tensor], skip: frozenset[int] = frozenset()) -> list[torch.Tensor]:
        """The outputs on the CPU, C-contiguous; those at `skip` (written elsewhere: CUDA buffers)
        become meta tensors of their shape and dtype, holding no memory."""
        outs = [torch.empty(t.shape, dtype=t.dtype, device="meta") if k in skip else t for k, t in enumerate(outs)]
        if self.device.type != "cpu":
            outs = [t if k in skip else t.to("cpu", non_blocking=True) for k, t in enumerate(outs)]
            torch.cuda.current_stream(self.device).synchronize()
        return [t if k in skip else t.contiguous() for k, t in enumerate(outs)]

    def _map(self, result) -> list[torch.Tensor]:
        names = [o.name for o in self.outputs]
        if isinstance(result, torch.Tensor):
            result = [result]
        if isinstance(result, dict):
            missing = [n for n in names if n not in result]
            if missing:
                raise OutputMismatch(f"model returned keys {sorted(result)}, missing declared outputs {missing}")
            return [result[n] for n in names]
        if isinstance(result, (tuple, list)):
            if len(result) != len(names):
                raise OutputMismatch(f"model returned {len(result)} tensors, {len(names)} outputs are declared {names}")
            return list(result)
        raise OutputMismatch(f"model returned {type(result).__name__}; expected a tensor, tuple, list or dict")


def load_verified(spec: ModelSpec, device: torch.device) -> Program:
    """Load a private copy of the file, hashed and its format told as it was copied: what loads
    is what was checked even if the file changes meanwhile. The copy is an anonymous in-memory
    file (memfd) torch reads record by record, so the load's RSS peak is about the model itself
    (measured for 64 MiB of weights: +69 MiB; loading a BytesIO of the file peaked at +259 MiB)."""
    fd = os.memfd_create("tgw-model", os.MFD_CLOEXEC)
    try:
        digest = hashlib.sha256()
        with open(spec.path, "rb") as f:
            while chunk := f.read(COPY_CHUNK):
                digest.update(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
        if spec.sha256 is not None and digest.hexdigest() != spec.sha256.lower():
            raise ChecksumMismatch(f"{spec.path}: sha256 is {digest.hexdigest()}, expected {spec.sha256}")
        with open(f"/proc/self/fd/{fd}", "rb") as copy:
            fmt = detect(copy, spec.format, where=spec.path)
            copy.seek(0)
            return load_in_process(fmt, copy, device, origin=spec.path)
    finally:
        os.close(fd)


def padded(inputs: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """`inputs` grown to `rows` rows by repeating their last row (zeros when they have none): a
    real row, so the model's own input checks pass it as they passed the row itself."""
    return [torch.cat([x, x[-1:].expand(rows - len(x), *x.shape[1:])]) if len(x) else
            x.new_zeros((rows, *x.shape[1:])) for x in inputs]


def _check(decl: IOSpec, t: torch.Tensor, rows: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise OutputMismatch(f"output {decl.name!r} is {type(t).__name__}, not a tensor")
    if t.dtype != TORCH_DTYPES[decl.dtype]:
        raise OutputMismatch(f"output {decl.name!r} is {str(t.dtype).removeprefix('torch.')}, declared {decl.dtype}")
    shape = list(t.shape)
    ok = len(shape) == len(decl.shape) + 1 and shape[0] == rows and all(
        d == -1 or d == s for d, s in zip(decl.shape, shape[1:]))
    if not ok:
        raise OutputMismatch(f"output {decl.name!r} has shape {shape}, declared [{rows}, "
                             f"{', '.join(map(str, decl.shape))}] (-1 = any)")
