"""One loaded stage (docs/STAGES.md): its handler class imported and instantiated, set up once,
warmed up, and called on batches - the counterpart of runner.ModelRunner for format "stage".

A handler is "/abs/file.py:Class" or "package.module:Class" (handler_class.py imports it).
`make_runner` picks the runner a spec calls for: a generator's (generate/runner.py), a stage's
or a model file's.
"""
from __future__ import annotations

from typing import Any

import torch

from tgw.shm.wire import ModelSpec, model_key

from .generate.runner import GeneratorRunner
from .handler_class import StageLoadError, handler_dir, load_class, made, set_up  # noqa: F401 - StageLoadError, load_class re-exported
from .model_shapes import plain, stage_inputs, stage_result
from .runner import ModelRunner
from .sequence_runner import SequenceRunner, make_sequence_runner
from .stage import StageBatch
from .stage_outputs import host_outputs
from .stage_proof import prove


class StageRunner:
    """Serves one stage version; its interface is the one the loader and serving loop use of a
    ModelRunner (key, outputs, nbytes, min_batch, warm_up, module), plus `call`."""

    def __init__(self, spec: ModelSpec, device: torch.device):
        self.spec, self.outputs = spec, spec.outputs
        self.plain = plain(spec)   # the batch path skips model_shapes for the common case
        # a cuda stage runs on this worker's GPU; a cpu stage on the CPU even on a GPU worker
        self.device = device if spec.device == "cuda" else torch.device("cpu")
        self.nbytes, self.min_batch = 0, 1
        self.footprint = None   # measured at load and warm-up (footprint.warm_measured)
        self.module, self.code_file = made(spec, f"stage {self.key}")   # code_file: where its frames are told from
        if not callable(self.module):
            raise StageLoadError(f"stage {self.key}: {type(self.module).__name__} has no __call__(batch) (nor "
                                 "execute(requests), which a Triton Python model has)")
        set_up(self.module, spec, self.device)

    @property
    def key(self) -> str:
        return model_key(self.spec.name, self.spec.version)

    @property
    def label(self) -> str:
        return f"stage {self.spec.name} version {self.spec.version}"

    def warm_up(self) -> None:
        """Its own warmup(), then the proof: one call per warmup_inputs example (stage_proof.py)."""
        warmup = getattr(self.module, "warmup", None)
        if warmup is not None:
            warmup()
        prove(self.label, self.key, self.spec.inputs, self.spec.warmup_inputs, handler_dir(self.spec.handler),
              self.call, self.module, self.code_file, self.device)

    def call(self, inputs: dict[str, Any], rows: int, starts: list[int] | None = None,
             ids: list[int] | None = None) -> tuple[list, dict[int, str]]:
        """One batch through the stage: its outputs in declared order, checked and on the host
        (torch tensors, or stage_outputs.PackedBytes for bytes), and the rows it failed.
        `starts`: where each request's rows begin, and the end; `ids`: the requests' ids."""
        if not self.plain:
            inputs = stage_inputs(self.spec, inputs)
        batch = StageBatch(rows, self.device, inputs, starts, ids)
        with torch.no_grad():   # not inference_mode: a stage may keep tensors it made across batches
            result = self.module(batch)
        if not self.plain:
            result = stage_result(self.spec, result)
        return host_outputs(self.label, self.outputs, result, rows), batch.failed


def make_runner(spec: ModelSpec, device: torch.device) -> ModelRunner | StageRunner | GeneratorRunner | SequenceRunner:
    """The runner a spec calls for: a sequence model's (sequence_runner.py), a generator's (a
    stage with `generator`), a stage's (format "stage") or a model file's."""
    if spec.sequence is not None:
        return make_sequence_runner(spec, device)
    if spec.format == "stage":
        return GeneratorRunner(spec, device) if spec.generator is not None else StageRunner(spec, device)
    return ModelRunner(spec, device)
