"""One pipeline as the broker serves it: its steps in order, what each reads and which of its
outputs are needed later, and the pipeline's derived inputs and outputs (pure, no I/O)."""
from __future__ import annotations

from tgw.shm.wire import IOSpec, ModelInfo, ModelMetadata, VersionInfo

from tgw.broker.config.pipelines import PipelineDecl, Source, derive, parse_source


class StepPlan:
    __slots__ = ("name", "model", "version", "feeds", "needs", "wanted")

    def __init__(self, name: str, model: str, version: str | None, feeds: list[tuple[str, str]]):
        self.name, self.model, self.version = name, model, version
        self.feeds = feeds                     # (the model's input, the source it reads: input or "step.output")
        self.needs = frozenset(s.step for _, text in feeds if (s := parse_source(text)).step is not None)
        self.wanted: list[str] = []            # its outputs read by later steps or the pipeline's outputs

    def label(self, pipeline: str) -> str:
        """How errors name it: `pipeline P step S (model M)`."""
        return f"pipeline {pipeline} step {self.name} (model {self.model})"


class Plan:
    """A checked pipeline declaration (config/pipelines.py `problems` found nothing), planned
    against its models' declarations."""

    def __init__(self, decl: PipelineDecl, models: dict):
        """`models`: model declarations by name (ModelDecl)."""
        self.decl = decl
        self.name, self.version, self.timeout_ms = decl.name, decl.version, decl.timeout_ms
        derived = derive(decl, models)
        self.inputs: list[IOSpec] = derived.inputs
        self.outputs: list[IOSpec] = derived.outputs
        self.max_batch_size = derived.max_batch_size
        self.input_specs = {t.name: t for t in self.inputs}
        self.output_names = [t.name for t in self.outputs]
        self.output_sources: dict[str, Source] = {n: parse_source(text) for n, text in decl.outputs.items()}
        self.steps = [StepPlan(s.name, s.model, s.version, list(s.inputs.items())) for s in decl.steps]
        by_name = {s.name: s for s in self.steps}
        reads = [parse_source(text) for s in self.steps for _, text in s.feeds] + list(self.output_sources.values())
        for src in reads:
            if src.step is not None and src.name not in by_name[src.step].wanted:
                by_name[src.step].wanted.append(src.name)
        self.models = sorted({s.model for s in self.steps})

    def info(self, ready: bool) -> ModelInfo:
        """As ListModels shows it, beside the models."""
        return ModelInfo(name=self.name, versions=[self.version], default_version=self.version,
                         max_batch_size=self.max_batch_size, inputs=self.inputs, outputs=self.outputs, ready=ready,
                         steps=[s.name for s in self.steps])

    def metadata(self, ready: bool) -> ModelMetadata:
        """As native Metadata shows it: one version, the pipeline's, of format "pipeline"."""
        return ModelMetadata(name=self.name, inputs=self.inputs, outputs=self.outputs,
                             max_batch_size=self.max_batch_size, default_version=self.version, residency="always",
                             versions=[VersionInfo(version=self.version, path="", format="pipeline",
                                                   state="ready" if ready else "loading")])

    def uses(self, model: str) -> list[StepPlan]:
        return [s for s in self.steps if s.model == model]
