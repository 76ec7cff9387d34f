"""One loaded generator (docs/GENERATION.md): its handler class imported like a stage's,
instantiated and set up once, its slot pool allocated once, warmed up with one prefill and one
step, then called by the step loop (loop.py) - the counterpart of StageRunner for a stage with
`generator:`.

The pool: per declared state tensor, zeros [slots, *shape] on the generator's device, allocated
here and never again (slot_pool.py sizes and makes it; its bytes are the runner's `nbytes`).

Warm-up proves the generator before it serves, as a stage's warmup_inputs do (stage_proof.py): a
one-row sequence (the first warmup_inputs example, else zeros of length 1 per -1 dim, b"a" per
bytes element) prefilled in slot 0 and stepped once. An exception or a return that breaks the
declaration fails the load with the handler's message and file:line.
"""
from __future__ import annotations

from typing import Any

import torch

from tgw.shm.bytes_tensor import BYTES
from tgw.shm.wire import ModelSpec, model_key

from ..failure_where import code_where, definition_where
from ..generator import PrefillBatch, StepBatch
from .. import slot_pool
from ..handler_class import StageLoadError, handler_dir, made, set_up
from ..runner import TORCH_DTYPES
from ..slot_pool import PoolSizeError, slot_bytes
from ..stage_proof import example_inputs
from .returns import ReturnError, Returned, checked
from .sampling import sample


class GeneratorLoadError(PoolSizeError):
    """A generator whose slot pool cannot be sized or made."""


class GeneratorProofError(RuntimeError):
    """A generator that failed its warm-up sequence: it is not served."""


def pool_slots(spec: ModelSpec) -> int:
    """A generator's slots (slot_pool.pool_slots)."""
    try:
        return slot_pool.pool_slots(spec.generator)
    except PoolSizeError as exc:
        raise GeneratorLoadError(str(exc)) from None


class GeneratorRunner:
    """Serves one generator version; the interface the loader and serving loop use of a runner
    (key, outputs, nbytes, min_batch, warm_up, module, footprint), plus its pool, `slots`,
    `prefill` and `step`."""

    def __init__(self, spec: ModelSpec, device: torch.device):
        self.spec, self.outputs, self.gen = spec, spec.outputs, spec.generator
        self.device = device if spec.device == "cuda" else torch.device("cpu")
        self.min_batch = 1
        self.footprint = None   # measured at load and warm-up (footprint.warm_measured)
        self.slots = pool_slots(spec)
        self.slot_bytes = slot_bytes(self.gen.state)[0]
        self.module, self.code_file = made(spec, self.label)
        missing = [m for m in ("prefill", "step") if not callable(getattr(self.module, m, None))]
        if missing:
            raise StageLoadError(f"{self.label}: {type(self.module).__name__} has no "
                                 f"{' and no '.join(f'{m}(batch)' for m in missing)}")
        set_up(self.module, spec, self.device)
        self.state = slot_pool.new_pool(self.gen.state, self.slots, self.device)
        self.nbytes = self.slots * self.slot_bytes   # the pool is resident however the allocator reports it
        names = [t.name for t in spec.inputs]
        self.length_input = self.gen.length_input or names[0]

    @property
    def key(self) -> str:
        return model_key(self.spec.name, self.spec.version)

    @property
    def label(self) -> str:
        return f"generator {self.spec.name} version {self.spec.version}"

    def blame(self, phase: str, exc: BaseException) -> str:
        """Where a failure of `phase` is told from: the returning method's definition for a bad
        return, else the innermost frame in the handler's file."""
        if isinstance(exc, ReturnError):
            return definition_where(getattr(self.module, phase))
        return code_where(exc, self.code_file)

    def prefill(self, inputs: dict[str, list], prefix: dict[str, list[torch.Tensor]],
                slots: list[int]) -> tuple[Returned, dict[int, str]]:
        """One prefill call: its checked return and the rows the handler failed."""
        batch = PrefillBatch(len(slots), self.device, torch.tensor(slots, dtype=torch.long, device=self.device),
                             self.state, inputs, prefix)
        with torch.no_grad():
            result = self.module.prefill(batch)
        return checked(result, batch.rows, self.outputs, "prefill"), batch.failed

    def step(self, last: dict[str, torch.Tensor], positions: list[int], slots: list[int]) -> tuple[Returned, dict[int, str]]:
        """One step call over rows whose last outputs are `last` (name -> [rows, *shape] on the CPU)."""
        rows = len(slots)
        batch = StepBatch(rows, self.device, torch.tensor(slots, dtype=torch.long, device=self.device), self.state,
                          {k: v.to(self.device) for k, v in last.items()},
                          torch.tensor(positions, dtype=torch.long, device=self.device))
        with torch.no_grad():
            result = self.module.step(batch)
        return checked(result, rows, self.outputs, "step"), batch.failed

    def values(self, returned: Returned, temperature: list[float], top_k: list[int], top_p: list[float],
               seeds: list[int], positions: list[int]) -> dict[str, torch.Tensor]:
        """Each declared output's rows [rows, *shape] on the CPU: sampled from logits, or as returned."""
        if returned.logits is None:
            return returned.values
        out = self.outputs[0]
        picked = sample(returned.logits, temperature, top_k, top_p, seeds, positions)
        return {out.name: picked.to(TORCH_DTYPES[out.dtype])}

    def warm_up(self) -> None:
        """Its own warmup(), then one prefill of a one-row sequence in slot 0 and one step."""
        warmup = getattr(self.module, "warmup", None)
        if warmup is not None:
            warmup()
        inputs = self._example()
        prefix = {t.name: [torch.zeros([0, *t.shape], dtype=TORCH_DTYPES[t.dtype], device=self.device)]
                  for t in self.outputs}
        phase = "prefill"
        try:
            returned, failed = self.prefill(inputs, prefix, [0])
            self._refuse_failed(phase, failed)
            first = self.values(returned, [0.0], [0], [1.0], [0], [0])
            length = returned.lengths[0] if returned.lengths else prompt_length(inputs[self.length_input][0])
            phase = "step"
            returned, failed = self.step(first, [length], [0])
            self._refuse_failed(phase, failed)
            self.values(returned, [0.0], [0], [1.0], [0], [1])
        except GeneratorProofError:
            raise
        except Exception as exc:
            where = self.blame(phase, exc) or "an unknown place"
            if isinstance(exc, ReturnError):
                raise GeneratorProofError(f"{self.label}: warm-up {exc} (returned by {where})") from None
            raise GeneratorProofError(f"{self.label}: warm-up {phase} raised {type(exc).__name__}: {exc} "
                                      f"(at {where})") from None

    def _refuse_failed(self, phase: str, failed: dict[int, str]) -> None:
        if failed:
            raise GeneratorProofError(f"{self.label}: warm-up {phase} failed its own warm-up row: {failed[0]} "
                                      f"({definition_where(getattr(self.module, phase))})")

    def _example(self) -> dict[str, list]:
        """The warm-up sequence's inputs, one row each, as a prefill gets them."""
        if self.spec.warmup_inputs:
            one = example_inputs(self.spec.inputs, self.spec.warmup_inputs[0], handler_dir(self.spec.handler),
                                 self.device)
            return {name: [value[0]] for name, value in one.items()}
        out: dict[str, list] = {}
        for t in self.spec.inputs:
            dims = [1 if d == -1 else d for d in t.shape]
            if t.dtype == BYTES:
                out[t.name] = [_nested_bytes(dims)]
            else:
                out[t.name] = [torch.zeros(dims, dtype=TORCH_DTYPES[t.dtype], device=self.device)]
        return out


def _nested_bytes(dims: list[int]) -> Any:
    if not dims:
        return b"a"
    return [_nested_bytes(dims[1:]) for _ in range(dims[0])]


def prompt_length(row: Any) -> int:
    """A prompt row's element count (its default length): a tensor's numel, a bytes row's elements."""
    if isinstance(row, torch.Tensor):
        return row.numel()
    if isinstance(row, list):
        return sum(prompt_length(r) for r in row)
    return 1
