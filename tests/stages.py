"""Small stages the tests serve (copied into a model root as a handler file, or imported as
the module `stages` with tests/ on sys.path). STAGES maps each class name to its declared
inputs and outputs, as tests/models.py's MODELS does for models."""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from tgw.workers.stage import Stage, StageBatch, StageContext

BYTES_IN = [{"name": "data", "dtype": "bytes", "shape": []}]
BYTES_OUT = [{"name": "data", "dtype": "bytes", "shape": []}]
X_IN = [{"name": "x", "dtype": "float32", "shape": [4]}]
Y_OUT = [{"name": "y", "dtype": "float32", "shape": [4]}]


class Echo(Stage):
    """Each element back, and its length."""

    def __call__(self, batch: StageBatch) -> dict:
        data = batch["data"]
        return {"data": list(data), "length": np.array([len(d) for d in data], dtype=np.int64)}


class Upper(Stage):
    """Each element upper-cased."""

    def __call__(self, batch: StageBatch) -> dict:
        return {"data": [d.upper() for d in batch["data"]]}


class RowFails(Stage):
    """Each element back; fails each row whose element starts with b"bad"."""

    def __call__(self, batch: StageBatch) -> dict:
        for row, d in enumerate(batch["data"]):
            if d.startswith(b"bad"):
                batch.fail(row, f"row {row} starts with 'bad': {d[:20]!r}")
        return {"data": list(batch["data"])}


class Crash(Stage):
    """Each element back; ends its worker process when an element equals b"crash"."""

    def __call__(self, batch: StageBatch) -> dict:
        if any(d == b"crash" for d in batch["data"]):
            os._exit(3)
        return {"data": list(batch["data"])}


class Sleepy(Stage):
    """x + 1 after sleeping options["ms"] milliseconds a batch (default 0)."""

    def setup(self, context: StageContext) -> None:
        self.seconds = float(context.options.get("ms", 0)) / 1000.0

    def __call__(self, batch: StageBatch) -> dict:
        if self.seconds:
            time.sleep(self.seconds)
        return {"y": batch["x"] + 1}


class AddOne(Stage):
    """x + 1 (as a torch tensor on the batch's device)."""

    def __call__(self, batch: StageBatch) -> dict:
        return {"y": batch["x"] + 1}


class Tagged(Stage):
    """Each element with options["tag"] appended, and what setup was told (name, version, the
    handler's folder, the device and the threads) as one string per row: proves the context."""

    def setup(self, context: StageContext) -> None:
        self.tag = str(context.options.get("tag", "")).encode()
        self.context = (f"{context.name}|{context.version}|{os.path.basename(context.dir)}|"
                        f"{context.device.type}|{context.threads}")
        self.warmed = False

    def warmup(self) -> None:
        self.warmed = True

    def __call__(self, batch: StageBatch) -> dict:
        info = f"{self.context}|warmed={self.warmed}"
        return {"data": [d + self.tag for d in batch["data"]], "context": [info] * batch.rows}


class OnDevice(Stage):
    """x * 2 on the batch's device; `where` tells which device each input tensor was on."""

    def __call__(self, batch: StageBatch) -> dict:
        x = batch["x"]
        return {"y": x * 2, "where": [str(x.device)] * batch.rows}


class WrongOutput(Stage):
    """Returns y as float64 where float32 is declared: a MODEL_EXECUTION_ERROR naming stage and output."""

    def __call__(self, batch: StageBatch) -> dict:
        return {"y": torch.zeros((batch.rows, 4), dtype=torch.float64)}


STAGES = {
    "Echo": {"inputs": BYTES_IN, "outputs": [*BYTES_OUT, {"name": "length", "dtype": "int64", "shape": []}]},
    "Upper": {"inputs": BYTES_IN, "outputs": BYTES_OUT},
    "RowFails": {"inputs": BYTES_IN, "outputs": BYTES_OUT},
    "Crash": {"inputs": BYTES_IN, "outputs": BYTES_OUT},
    "Sleepy": {"inputs": X_IN, "outputs": Y_OUT},
    "AddOne": {"inputs": X_IN, "outputs": Y_OUT},
    "Tagged": {"inputs": BYTES_IN, "outputs": [*BYTES_OUT, {"name": "context", "dtype": "bytes", "shape": []}]},
    "OnDevice": {"inputs": X_IN, "outputs": [*Y_OUT, {"name": "where", "dtype": "bytes", "shape": []}]},
    "WrongOutput": {"inputs": X_IN, "outputs": Y_OUT},
}


def stage_entry(handler: str, cls: str, name: str | None = None, **overrides) -> dict:
    """A config model entry serving class `cls` of `handler` (a path relative to the config's
    folder, or a module), its inputs and outputs from STAGES."""
    entry = {"name": name or cls.lower(), "versions": [{"version": "1", "handler": f"{handler}:{cls}"}],
             **STAGES[cls], "max_batch_size": 8}
    entry.update(overrides)
    return entry
