"""The demo's sequence models (docs/SEQUENCES-MODEL.md), built locally (nothing is downloaded):

* `accumulator`: a TorchScript file written exactly as for Triton's PyTorch backend and its
  implicit state examples: INPUT (int32 [1]), control inputs START, END and READY, implicit state
  INPUT_STATE / OUTPUT_STATE; OUTPUT is the running sum of the sequence's INPUTs, reset at START.
* `tiny-rnn`: a handler class (workers/sequence.py) with a small GRU cell whose hidden state is
  kept in `batch.state["h"]`; its output is the new hidden state.

`build_sequence_decls(DIR)` writes the accumulator's file and returns both declarations as the
demo config takes them.
"""
from __future__ import annotations

import os

import torch
from torch import nn

ACCUMULATOR_FILE = "accumulator-v1.pt"
RNN_INPUT, RNN_HIDDEN = 4, 8


class Accumulator(nn.Module):
    """Triton's implicit-state accumulator: its forward takes the request's input, then the
    control inputs, then the state, by the names its config declares (Triton's FORWARD_ARGUMENT)."""

    def forward(self, INPUT: torch.Tensor, START: torch.Tensor, END: torch.Tensor, READY: torch.Tensor,  # noqa: N803
                INPUT_STATE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: N803
        state = torch.where(START == 1, torch.zeros_like(INPUT_STATE), INPUT_STATE)
        total = state + INPUT * READY
        return total, total


def save_accumulator(path: str) -> None:
    torch.jit.save(torch.jit.script(Accumulator().eval()), path)


class TinyRNN:
    """A GRU cell stepped once per request; the hidden state lives in the worker's slot pool."""

    def setup(self, context) -> None:
        self.cell = make_cell(int(context.options.get("seed", 7))).to(context.device).eval()

    def step(self, batch) -> dict:
        h = batch.state["h"]
        new = self.cell(batch["x"], h[batch.slots])
        h[batch.slots] = new
        return {"y": new}


def make_cell(seed: int = 7) -> nn.GRUCell:
    """The demo cell's weights (a fixed seed: the reference in tests builds the same)."""
    torch.manual_seed(seed)
    return nn.GRUCell(RNN_INPUT, RNN_HIDDEN)


def build_sequence_decls(out_dir: str) -> dict:
    """name -> its declaration (a model file's {path, format, ...} or a handler's {handler,
    device, options, ...}), each with `sequence_batching`."""
    path = os.path.join(out_dir, ACCUMULATOR_FILE)
    if not os.path.exists(path):
        save_accumulator(path)
    return {
        "accumulator": {
            "path": path, "format": "torchscript", "max_batch_size": 64,
            "inputs": [{"name": "INPUT", "dtype": "int32", "shape": [1]}],
            "outputs": [{"name": "OUTPUT", "dtype": "int32", "shape": [1]}],
            "sequence_batching": {
                "max_sequences": 64, "max_sequence_idle_us": 5_000_000,
                "control_inputs": [{"name": "START", "kind": "start", "dtype": "int32"},
                                   {"name": "END", "kind": "end", "dtype": "int32"},
                                   {"name": "READY", "kind": "ready", "dtype": "int32"}],
                "state": [{"name": "INPUT_STATE", "output": "OUTPUT_STATE", "dtype": "int32", "shape": [1]}]}},
        "tiny-rnn": {
            "handler": "tgw.workers.demo_sequence:TinyRNN", "device": "cpu", "options": {"seed": 7},
            "max_batch_size": 64,
            "inputs": [{"name": "x", "dtype": "float32", "shape": [RNN_INPUT]}],
            "outputs": [{"name": "y", "dtype": "float32", "shape": [RNN_HIDDEN]}],
            "sequence_batching": {
                "max_sequences": 64, "max_sequence_idle_us": 5_000_000,
                "state": [{"name": "h", "dtype": "float32", "shape": [RNN_HIDDEN]}]}},
    }
