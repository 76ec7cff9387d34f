"""The Directory the hub publishes to the front processes (wire.py): the registry and the
pipelines as the faces read them, and the load report's header.

Built only when something it is made of may have changed - the registry's generation, the
pipeline table's plans, the header - so the lifecycle's periodic look costs a tuple compare
while nothing changes. `generation` grows with every change a front is sent: a model or
pipeline, the drain notice, or the header (refreshed at most every HEADER_S: the fronts attach
it to their answers, as the broker's own faces do).
"""
from __future__ import annotations

from typing import Callable

from tgw.shm.wire_base import as_builtins

from .wire import Directory, FrontModel, FrontPipeline

HEADER_S = 1.0   # the load header sent at most this often (it changes on every refresh, 10 a second)


class DirectoryBook:
    def __init__(self, registry, pipelines, load, clock: Callable[[], float]):
        """`registry`: models/registry.Registry; `pipelines`: pipeline/executor.Pipelines (its
        `table`); `load`: observe/load.LoadReport (its `header`, as the lifecycle refreshes it)."""
        self.registry, self.pipelines, self.load, self.clock = registry, pipelines, load, clock
        self.current = Directory(generation=0, models={})
        self._key: tuple | None = None        # what the models and pipelines were built from
        self._header_at = float("-inf")

    def refresh(self, force_header: bool = False) -> bool:
        """Rebuild what may have changed; True when the directory changed (its generation grew)."""
        key = (self.registry.generation, tuple((n, id(p)) for n, p in self.pipelines.table.items()))
        old = self.current
        models, pipelines = old.models, old.pipelines
        if key != self._key:
            self._key = key
            models, pipelines = self._models(), self._pipelines()
        header, draining = old.load_header, self.load.draining
        now = self.clock()
        if force_header or now - self._header_at >= HEADER_S or draining != old.draining:
            header = self.load.header
            self._header_at = now
        if models == old.models and pipelines == old.pipelines and header == old.load_header \
                and draining == old.draining:
            return False
        self.current = Directory(generation=old.generation + 1, models=models, pipelines=pipelines,
                                 load_header=header, draining=draining)
        return True

    def _models(self) -> dict[str, FrontModel]:
        return {name: FrontModel(decl=m.decl.model_dump(mode="json"), versions=list(m.records),
                                 generator=bool(m.is_generator), default=m.default)
                for name, m in self.registry.models.items() if not m.removed}

    def _pipelines(self) -> dict[str, FrontPipeline]:
        return {name: FrontPipeline(inputs=[as_builtins(t) for t in plan.inputs], max_batch_size=plan.max_batch_size,
                                    version=plan.version, sources=_sources(plan))
                for name, plan in self.pipelines.table.items()}


def _sources(plan) -> dict[str, list[str]]:
    """Each output a step's model makes: [that model, its output's name] (the labels it shows)."""
    models = {step.name: step.model for step in plan.steps}
    return {out: [models[src.step], src.name] for out, src in plan.output_sources.items() if src.step is not None}
