"""One loaded sequence model (docs/SEQUENCES-MODEL.md): its slot pool (slot_pool.py) allocated
once at load, its start rows' slots reset to the states' initial values before each batch, and
its model called the way its kind wants.

* A handler class (SequenceStageRunner): `step(batch)` with a sequence.SequenceBatch; it reads and
  writes the pool itself.
* A model file written for Triton's PyTorch backend (SequenceFileRunner): called with the
  declared inputs, then the control inputs, then the state inputs (the rows `pool[slots]`); it
  returns the declared outputs, then each state's next value, which is written back to the slots
  and never sent. Order: the config's, unless the program names its inputs (a torch.export
  program's, or a TorchScript forward's argument names: matched by name, as Triton's
  FORWARD_ARGUMENT) or every name ends in `__<index>` (Triton's NAMED_INDEX: by index); outputs
  by `__<index>` too when every one has it. An inner ModelRunner over the full list checks the
  program, its outputs' dtypes and shapes.

Warm-up: a one-row batch in slot 0 starting (and ending) a sequence, then slot 0 reset, so a model
that breaks its declaration fails the load with a clear message.
"""
from __future__ import annotations

import re
from typing import Any

import msgspec
import torch

from tgw.shm.bytes_tensor import BYTES
from tgw.shm.wire import IOSpec, ModelSpec, SeqStep, model_key

from . import slot_pool
from .failure_where import code_where
from .handler_class import StageLoadError, handler_dir, made, set_up
from .formats import Program
from .runner import TORCH_DTYPES, ModelRunner, OutputMismatch, load_verified
from .sequence import SequenceBatch
from .stage_outputs import host_outputs
from .stage_proof import example_inputs

INDEXED = re.compile(r"__(\d+)$")
WARM_ID = 1   # the warm-up sequence's correlation id (a valid uint64 and, as "1", string id)


class SequenceProofError(RuntimeError):
    """A sequence model that failed its warm-up step: it is not served."""


class SequenceRunner:
    """What both kinds share: the pool and the interface the loader and serving loop use of a
    runner (key, label, outputs, nbytes, slots, min_batch, footprint, module, code_file)."""
    code_file = ""

    def __init__(self, spec: ModelSpec, device: torch.device):
        self.spec, self.outputs, self.seq = spec, spec.outputs, spec.sequence
        self.device = device
        self.min_batch, self.footprint = 1, None
        self.slots = slot_pool.pool_slots(self.seq, "a sequence model")
        self.pool_bytes = self.slots * slot_pool.slot_bytes(self.seq.state)[0]

    @property
    def key(self) -> str:
        return model_key(self.spec.name, self.spec.version)

    @property
    def label(self) -> str:
        return f"sequence model {self.spec.name} version {self.spec.version}"

    def _make_pool(self) -> None:
        self.state = slot_pool.new_pool(self.seq.state, self.slots, self.device)

    def checked_steps(self, steps: list[SeqStep], rows: int) -> torch.Tensor:
        """The rows' slots (long, on the device), after the broker's steps are checked."""
        if len(steps) != rows:
            raise ValueError(f"{self.label}: a batch of {rows} rows came with {len(steps)} sequence steps "
                             "(one request of one row per step)")
        slots = [s.slot for s in steps]
        bad = [s for s in slots if not 0 <= s < self.slots]
        if bad:
            raise ValueError(f"{self.label}: slots {bad} are outside its pool of {self.slots}")
        if len(set(slots)) != len(slots):
            raise ValueError(f"{self.label}: a batch steps slot(s) {sorted({s for s in slots if slots.count(s) > 1})} "
                             "twice (a sequence takes one step a batch)")
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def reset(self, steps: list[SeqStep]) -> None:
        """Each start row's slot set to the states' initial values."""
        starting = [s.slot for s in steps if s.start]
        if starting:
            at = torch.tensor(starting, dtype=torch.long, device=self.device)
            for s in self.seq.state:
                self.state[s.name][at] = s.initial

    def flags(self, steps: list[SeqStep]) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor([s.start for s in steps], dtype=torch.bool, device=self.device),
                torch.tensor([s.end for s in steps], dtype=torch.bool, device=self.device))

    def warm_step(self) -> list[SeqStep]:
        corrid: Any = WARM_ID if getattr(self.spec.sequence, "correlation_id", "uint64") != "string" else str(WARM_ID)
        return [SeqStep(slot=0, corrid=corrid, start=True, end=True)]

    def clear_slot0(self) -> None:
        for s in self.seq.state:
            self.state[s.name][0] = s.initial


class SequenceStageRunner(SequenceRunner):
    """A handler class's sequence model."""

    def __init__(self, spec: ModelSpec, device: torch.device):
        super().__init__(spec, device if spec.device == "cuda" else torch.device("cpu"))
        self.module, self.code_file = made(spec, self.label)
        if not callable(getattr(self.module, "step", None)):
            raise StageLoadError(f"{self.label}: {type(self.module).__name__} has no step(batch)")
        set_up(self.module, spec, self.device)
        self._make_pool()
        self.nbytes = self.pool_bytes

    def call(self, inputs: dict[str, Any], steps: list[SeqStep], rows: int) -> tuple[list, dict[int, str]]:
        """One batch: its outputs in declared order, checked and on the host, and the rows it failed."""
        slots = self.checked_steps(steps, rows)
        self.reset(steps)
        start, end = self.flags(steps)
        batch = SequenceBatch(rows, self.device, inputs, slots, start, end, [s.corrid for s in steps], self.state)
        with torch.no_grad():
            result = self.module.step(batch)
        return host_outputs(self.label, self.outputs, result, rows), batch.failed

    def warm_up(self) -> None:
        """Its own warmup(), then one step starting a sequence in slot 0 (reset after)."""
        warmup = getattr(self.module, "warmup", None)
        if warmup is not None:
            warmup()
        try:
            _, failed = self.call(self._example(), self.warm_step(), 1)
        except Exception as exc:
            where = code_where(exc, self.code_file) or "an unknown place"
            raise SequenceProofError(f"{self.label}: warm-up step raised {type(exc).__name__}: {exc} "
                                     f"(at {where})") from None
        if failed:
            raise SequenceProofError(f"{self.label}: warm-up step failed its own warm-up row: {failed[0]}")
        self.clear_slot0()

    def _example(self) -> dict[str, Any]:
        if self.spec.warmup_inputs:
            return example_inputs(self.spec.inputs, self.spec.warmup_inputs[0], handler_dir(self.spec.handler),
                                  self.device)
        out: dict[str, Any] = {}
        for t in self.spec.inputs:
            dims = [1 if d == -1 else d for d in t.shape]
            out[t.name] = ([_bytes_row(dims)] if t.dtype == BYTES else
                           torch.zeros([1, *dims], dtype=TORCH_DTYPES[t.dtype], device=self.device))
        return out


class SequenceFileRunner(SequenceRunner):
    """A model file written for Triton's PyTorch backend, with control inputs and implicit state."""

    def __init__(self, spec: ModelSpec, device: torch.device):
        super().__init__(spec, device)
        seq = self.seq
        fed = [*spec.inputs, *(IOSpec(name=c.name, dtype=c.dtype, shape=[1]) for c in seq.controls),
               *(IOSpec(name=s.name, dtype=s.dtype, shape=list(s.shape)) for s in seq.state)]
        returned = [*spec.outputs, *(IOSpec(name=s.output, dtype=s.dtype, shape=list(s.shape)) for s in seq.state)]
        full = msgspec.structs.replace(spec, outputs=_indexed(returned) or returned)
        program = load_verified(spec, device)
        self.inner = ModelRunner(msgspec.structs.replace(full, inputs=_program_order(program, fed)), device, program)
        self.module, self.nbytes = self.inner.module, self.inner.nbytes + self.pool_bytes
        self.min_batch = 1
        self._make_pool()
        self.out_at = {t.name: k for k, t in enumerate(self.inner.outputs)}

    def forward(self, inputs: list[torch.Tensor], steps: list[SeqStep], rows: int) -> list[torch.Tensor]:
        """One batch (inputs in declared order): the declared outputs, on the model's device."""
        slots = self.checked_steps(steps, rows)
        self.reset(steps)
        values = {t.name: x.to(self.device) for t, x in zip(self.spec.inputs, inputs)}
        for c in self.seq.controls:
            values[c.name] = _control(c, steps, self.device)
        for s in self.seq.state:
            values[s.name] = self.state[s.name][slots]
        outs = self.inner.forward([values[t.name] for t in self.inner.spec.inputs], rows)
        for s in self.seq.state:   # after the whole forward: a failed batch leaves the slots as they were
            self.state[s.name][slots] = outs[self.out_at[s.output]]
        return [outs[self.out_at[t.name]] for t in self.outputs]

    def run(self, inputs: list[torch.Tensor], steps: list[SeqStep], rows: int) -> list[torch.Tensor]:
        """forward, the outputs on the CPU, C-contiguous."""
        return self.inner.to_host(self.forward(inputs, steps, rows))

    def call(self, inputs: dict[str, Any], steps: list[SeqStep], rows: int) -> tuple[list, dict[int, str]]:
        """As SequenceStageRunner.call (a model file fails no single row)."""
        return self.run([inputs[t.name] for t in self.spec.inputs], steps, rows), {}

    def warm_up(self) -> dict[int, int]:
        """The inner runner's warm-up (zeros at each warm-up size: its outputs checked against the
        full list), then one step starting a sequence in slot 0 (reset after)."""
        try:
            sizes = self.inner.warm_up()
            self.run([torch.zeros([1, *(1 if d == -1 else d for d in t.shape)], dtype=TORCH_DTYPES[t.dtype])
                      for t in self.spec.inputs], self.warm_step(), 1)
        except OutputMismatch as exc:
            raise SequenceProofError(
                f"{self.label}: warm-up: {exc}; a model file returns its declared outputs "
                f"{[t.name for t in self.spec.outputs]}, then each state's next value "
                f"{[s.output for s in self.seq.state]}, as Triton's PyTorch backend expects") from None
        self.clear_slot0()
        return sizes


def _program_order(program: Program, fed: list[IOSpec]) -> list[IOSpec]:
    """`fed` in the order the program takes them (module docstring): by its own input names when
    they are the fed names (in any case), else by `__<index>` suffixes, else as declared."""
    names = list(program.names or [])
    if not names:
        schema = getattr(getattr(program.call, "forward", None), "schema", None)
        names = [a.name for a in schema.arguments[1:]] if schema is not None else []
    by_name = {t.name.lower(): t for t in fed}   # torch.export lowercases its placeholders' names
    if len(by_name) == len(fed) and sorted(n.lower() for n in names) == sorted(by_name):
        return [by_name[n.lower()] for n in names]
    return _indexed(fed) or fed


def _indexed(specs: list[IOSpec]) -> list[IOSpec] | None:
    """`specs` ordered by their `__<index>` suffixes when every name has one and they count 0..n-1."""
    found = [INDEXED.search(t.name) for t in specs]
    if not all(found):
        return None
    at = [int(m.group(1)) for m in found]
    if sorted(at) != list(range(len(specs))):
        return None
    return [t for _, t in sorted(zip(at, specs), key=lambda p: p[0])]


def _control(c, steps: list[SeqStep], device: torch.device) -> torch.Tensor:
    """A control input's [rows, 1]: start/end 1/0, ready 1 (every row tgw sends is ready), corrid the id."""
    dtype = TORCH_DTYPES[c.dtype]
    if c.kind == "corrid":
        ids = [s.corrid for s in steps]
        if dtype == torch.int64:   # a uint64 id past int64's range keeps its bits, as Triton hands it over
            ids = [i - (1 << 64) if i >= 1 << 63 else i for i in ids]
        return torch.tensor(ids, dtype=dtype, device=device).view(-1, 1)
    bits = [1] * len(steps) if c.kind == "ready" else [int(getattr(s, c.kind)) for s in steps]
    return torch.tensor(bits, dtype=dtype, device=device).view(-1, 1)


def _bytes_row(dims: list[int]) -> Any:
    return b"a" if not dims else [_bytes_row(dims[1:]) for _ in range(dims[0])]


def make_sequence_runner(spec: ModelSpec, device: torch.device) -> SequenceRunner:
    return SequenceStageRunner(spec, device) if spec.format == "stage" else SequenceFileRunner(spec, device)
