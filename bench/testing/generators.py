"""Small deterministic generators for tests and benchmarks (docs/GENERATION.md): no weights, no
training, every output computable by the test that reads it. A config names them as module
handlers, e.g. `handler: tgw.testing.generators:Counter`; `entry(...)` gives a whole model entry.

* `Counter`: output n of a prompt is (sum(prompt) + n) % 1000 (int64 scalar `value`, returned by
  name); its prompt may be int64 tokens or a `bytes` input (its byte values); prefill says each
  prompt's `lengths`. It checks what the worker hands its step (last outputs, positions) against
  its own state and fails a row whose inputs are wrong, so a test sees a loop that mixes rows up.
  Resumes exactly (the prefix's length is n).
* `ToyLM`: a sampled generator (int64 scalar `token`, returns `logits` [rows, vocab]) whose
  logits are a fixed hash of (last token, its position): greedy and seeded sampling are
  reproducible one row at a time (`toylm_reference`), independent of the batch.

Both take `options:` (all optional): `step_ms` (sleep per step: a slow model), `done_at` (say done
at output n), `raise_prefill_on` (raise in prefill when a prompt's first token is this),
`raise_at` (raise in step when a row's next output index is this), `fail_on` (batch.fail a row
in prefill whose first token is this), `bad_return` ("prefill" or "step": return a float32
output/logits of the wrong shape), `vocab` (ToyLM's, default 64).
"""
from __future__ import annotations

import time
from typing import Any

import torch

MODULE = "tgw.testing.generators"
VOCAB = 64


class _Knobs:
    """The options both generators share."""

    def setup(self, context) -> None:
        o = context.options
        self.device = context.device
        self.step_ms = float(o.get("step_ms", 0))
        self.done_at = o.get("done_at")
        self.raise_prefill_on = o.get("raise_prefill_on")
        self.raise_at = o.get("raise_at")
        self.fail_on = o.get("fail_on")
        self.bad_return = o.get("bad_return")
        self.vocab = int(o.get("vocab", VOCAB))

    def _prefill_knobs(self, batch) -> None:
        for row, prompt in enumerate(batch[self.input_name]):
            prompt = tokens_of(prompt)
            first = int(prompt.flatten()[0]) if prompt.numel() else None
            if self.raise_prefill_on is not None and first == self.raise_prefill_on:
                raise ValueError(f"prefill refuses prompts starting with {first}")
            if self.fail_on is not None and first == self.fail_on:
                batch.fail(row, f"prompt starts with {first}")

    def _step_knobs(self, next_index: torch.Tensor) -> None:
        if self.step_ms:
            time.sleep(self.step_ms / 1000)
        if self.raise_at is not None and bool((next_index == self.raise_at).any()):
            raise RuntimeError(f"step refuses output {self.raise_at}")

    def _done(self, index: torch.Tensor) -> torch.Tensor:
        return index == self.done_at if self.done_at is not None else torch.zeros_like(index, dtype=torch.bool)


class Counter(_Knobs):
    """Output n = (sum(prompt) + n) % 1000. State `acc` int64 [3]: sum, index of the last
    output, prompt length."""
    input_name = "prompt"

    def prefill(self, batch) -> dict[str, Any]:
        self._prefill_knobs(batch)
        acc = batch.state["acc"]
        lengths = []
        for row, prompt in enumerate(batch["prompt"]):
            prompt = tokens_of(prompt)
            n = batch.prefix["value"][row].shape[0]
            acc[batch.slots[row]] = torch.tensor([int(prompt.sum()), n, prompt.numel()], device=acc.device)
            lengths.append(prompt.numel())
        rows = acc[batch.slots]
        index = rows[:, 1]
        if self.bad_return == "prefill":
            return {"value": torch.zeros(len(batch), 2)}
        return {"value": (rows[:, 0] + index) % 1000, "done": self._done(index), "lengths": torch.tensor(lengths)}

    def step(self, batch) -> dict[str, Any]:
        acc = batch.state["acc"]
        rows = acc[batch.slots]
        want_last, want_pos = (rows[:, 0] + rows[:, 1]) % 1000, rows[:, 2] + rows[:, 1]
        for row in range(len(batch)):
            if int(batch["value"][row]) != int(want_last[row]) or int(batch.positions[row]) != int(want_pos[row]):
                batch.fail(row, f"step got last {int(batch['value'][row])} at {int(batch.positions[row])}, expected "
                                f"{int(want_last[row])} at {int(want_pos[row])}")
        index = rows[:, 1] + 1
        self._step_knobs(index)
        acc[batch.slots, 1] = index
        if self.bad_return == "step":
            return {"value": torch.zeros(len(batch), dtype=torch.float32)}
        return {"value": (rows[:, 0] + index) % 1000, "done": self._done(index)}


def tokens_of(prompt) -> torch.Tensor:
    """A prompt row as tokens: a tensor as it is, a bytes prompt (a `bytes` input) as its byte values."""
    if isinstance(prompt, torch.Tensor):
        return prompt
    data = b"".join(prompt) if isinstance(prompt, list) else prompt
    return torch.tensor(list(data), dtype=torch.int64)


def counter_outputs(prompt, n: int) -> list[int]:
    """Counter's first n outputs of `prompt` (token ids, or bytes)."""
    return [(sum(prompt) + k) % 1000 for k in range(n)]


def toylm_logits(last: torch.Tensor, position: torch.Tensor, vocab: int = VOCAB) -> torch.Tensor:
    """ToyLM's logits [rows, vocab] (float32) after token `last` at `position` (long [rows])."""
    v = torch.arange(vocab, device=last.device)
    h = (last[:, None] * 1_000_003 + position[:, None] * 7_919 + v[None, :] * 104_729) % 9_973
    return h.to(torch.float32) / 9_973 * 8 - 4


class ToyLM(_Knobs):
    """Logits of a fixed hash of (last token, position). State `n` int64 [2]: prompt length,
    outputs so far."""
    input_name = "prompt"

    def prefill(self, batch) -> dict[str, Any]:
        self._prefill_knobs(batch)
        state = batch.state["n"]
        last, pos = [], []
        for row, prompt in enumerate(batch["prompt"]):
            prefix = batch.prefix["token"][row]
            d = prefix.shape[0]
            last.append(int(prefix[-1]) if d else int(prompt.flatten()[-1]))
            pos.append(prompt.numel() + d - 1)
            state[batch.slots[row]] = torch.tensor([prompt.numel(), d], device=state.device)
        if self.bad_return == "prefill":
            return {"logits": torch.zeros(len(batch))}
        index = state[batch.slots][:, 1]
        return {"logits": toylm_logits(torch.tensor(last, device=state.device), torch.tensor(pos, device=state.device),
                                       self.vocab), "done": self._done(index)}

    def step(self, batch) -> dict[str, Any]:
        state = batch.state["n"]
        index = state[batch.slots][:, 1] + 1
        self._step_knobs(index)
        state[batch.slots, 1] = index
        if self.bad_return == "step":
            return {"logits": torch.zeros(len(batch))}
        return {"logits": toylm_logits(batch["token"], batch.positions, self.vocab), "done": self._done(index)}


def toylm_reference(prompt: list[int], max_outputs: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    seed: int = 0, stop_tokens: tuple = (), max_length: int = 0, vocab: int = VOCAB) -> list[int]:
    """ToyLM's outputs for one prompt, computed alone (one row, no worker): what a generation
    of it must stream, whatever its batch neighbours. Stops as the worker does: a stop token
    ends it unemitted; max_outputs and max_length after emitting."""
    from tgw.workers.generate.sampling import sample   # the worker's own sampler: the same draws

    out: list[int] = []
    last, pos = prompt[-1], len(prompt) - 1
    while True:
        logits = toylm_logits(torch.tensor([last]), torch.tensor([pos]), vocab)
        token = int(sample(logits, [temperature], [top_k], [top_p], [seed], [len(out)])[0])
        if token in stop_tokens:
            return out
        out.append(token)
        pos = len(prompt) + len(out) - 1
        if len(out) >= max_outputs or (max_length and pos >= max_length):
            return out
        last = token


def entry(name: str, cls: str = "Counter", options: dict | None = None, **generator) -> dict:
    """A config model entry for one of these generators; `generator` keys override the defaults
    (max_sequences 8, max_outputs 64)."""
    output = {"Counter": "value", "ToyLM": "token"}[cls]
    state = {"Counter": [{"name": "acc", "dtype": "int64", "shape": [3]}],
             "ToyLM": [{"name": "n", "dtype": "int64", "shape": [2]}]}[cls]
    gen = {"state": state, "max_sequences": 8, "max_outputs": 64, **generator}
    if "state_memory_mb" in generator:
        gen.pop("max_sequences")
    return {"name": name, "versions": [{"version": "1", "handler": f"{MODULE}:{cls}"}],
            "inputs": [{"name": "prompt", "dtype": "int64", "shape": [-1]}],
            "outputs": [{"name": output, "dtype": "int64", "shape": []}],
            **({"options": options} if options else {}), "generator": gen}
