"""The stage that the cancellation run (cancellation.py) and tests/process/test_cancellation.py serve:
it records every row it computes, so "never computed" is counted by the worker itself.

`Recorder` answers y = x + 1 (x: float32 [4] per row). Column 0 of a row is the caller's tag for
it; each batch appends the tags of the rows it computed, one line per batch, to the file
`options["log"]`. A batch holding a row whose column 1 is 1 (a "gate" row) waits, before it
computes, until the file `options["gate"]` exists (at most `options["gate_s"]`, default 120 s): the
slow batch the others queue and stage behind, which its caller opens - nothing waits on a clock.

Handler: "tgw.testing.cancel_stage:Recorder" (runs in the worker; this module imports torch).
"""
from __future__ import annotations

import os
import time

from tgw.workers.stage import Stage, StageBatch, StageContext

HANDLER = "tgw.testing.cancel_stage:Recorder"
GATE_POLL_S = 0.005


class Recorder(Stage):
    def setup(self, context: StageContext) -> None:
        self.log = str(context.options["log"])
        self.gate = str(context.options.get("gate", ""))
        self.gate_s = float(context.options.get("gate_s", 120))

    def __call__(self, batch: StageBatch) -> dict:
        x = batch["x"]
        if self.gate and bool((x[:, 1] == 1).any()):
            until = time.monotonic() + self.gate_s
            while not os.path.exists(self.gate) and time.monotonic() < until:
                time.sleep(GATE_POLL_S)
        tags = " ".join(str(int(v)) for v in x[:, 0].tolist())
        with open(self.log, "a") as f:
            f.write(tags + "\n")
        return {"y": x + 1}

