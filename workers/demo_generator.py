"""The embedded demo's generator: a small GPT-style decoder with an explicit KV cache, and TinyGPT,
its tgw handler (`handler: tgw.workers.demo_generator:TinyGPT`, the contract of
workers/generator.py; docs/GENERATION.md "A tested example").

* `TinyGPTModule`: token and position embeddings, pre-norm causal self-attention, an MLP, a head
  tied to the token embedding. `forward_tokens` runs T tokens of each row against that row's KV
  cache (rows may start at different positions); `step_tokens` is its one-token step.
* `build_gpt`: deterministic random weights, optionally trained for a few seconds on text tgw ships
  (demo_corpus.CORPUS, sentences ended by the end token) so that the demo's output reads like text.
* `TinyGPT`: the handler. Prompts are int64 token ids (demo_tokenizer: one id per UTF-8 byte);
  the KV cache is the config's state tensor `kv` [n_layers, 2, n_heads, max_len, head_dim] per slot.
* `reference_generate` and `check_against_reference`: the demo's exactness check (see the latter).
"""
from __future__ import annotations

import copy
import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .demo_tokenizer import END, Tokenizer
from .generator import Generator, PrefillBatch, StepBatch

__all__ = ["GPTConfig", "TinyGPTModule", "kv_shape", "build_gpt", "save_gpt", "load_gpt", "reference_generate",
           "float64_reference", "check_against_reference", "Verdict", "MARGIN", "Tokenizer", "END", "TinyGPT"]

# A token is checked only where the float64 reference's top two logits are further apart than
# this. tgw computes in float32 and in batches, whose rounding differs from one sequence alone:
# the demo model's worst |float32 - float64| logit difference measured 4.1e-5 (its 16 demo
# prompts, 120 outputs each; its logits reach ~17), so a gap above MARGIN (over 100 times that)
# cannot flip the argmax; a gap within it is a near tie, where either token is right and the
# sequences may part: the comparison stops there.
MARGIN = 5e-3


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 256      # positions (prompt + outputs) a sequence may reach: the KV cache's length
    d_ff: int = 0           # the MLP's width; 0: 4 * d_model

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "n_layers", "n_heads", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, not {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig: d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def width(self) -> int:
        return self.d_ff or 4 * self.d_model


def kv_shape(cfg: GPTConfig) -> list[int]:
    """One sequence's KV cache: [n_layers, 2 (keys, values), n_heads, max_len, head_dim]."""
    return [cfg.n_layers, 2, cfg.n_heads, cfg.max_len, cfg.head_dim]


class _Layer(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, cfg.width), nn.Linear(cfg.width, d)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPTModule(nn.Module):
    """A GPT-style decoder whose attention reads and writes an explicit KV cache."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok, self.pos = nn.Embedding(cfg.vocab, cfg.d_model), nn.Embedding(cfg.max_len, cfg.d_model)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        for m in self.modules():   # GPT-2's init: small weights, so untrained positions stay quiet
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head, tied to the token embedding: [..., d_model] -> [..., vocab]."""
        return hidden @ self.tok.weight.T

    def hidden(self, tokens: torch.Tensor, kv: torch.Tensor, start: torch.Tensor,
               slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The final hidden states [rows, T, d_model] of `tokens` [rows, T] at positions
        start[row] .. start[row] + T - 1, writing their keys and values into the KV cache: row r's
        is kv[r], or kv[slots[r]] when `slots` is given (kv then being a whole slot pool)."""
        cfg = self.cfg
        rows, steps = tokens.shape
        if slots is None:
            slots = torch.arange(rows, device=tokens.device)
        pos = start.reshape(rows, 1) + torch.arange(steps, device=tokens.device)   # [rows, T]
        length = int(pos.max()) + 1 if rows else 0   # keys read: the furthest row's
        if length > cfg.max_len:
            raise ValueError(f"position {length - 1} is past the model's max_len {cfg.max_len}")
        x = self.tok(tokens) + self.pos(pos)
        visible = (torch.arange(length, device=tokens.device) <= pos[:, :, None])[:, None]   # [rows, 1, T, keys]
        heads, hd = cfg.n_heads, cfg.head_dim
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(layer.ln1(x)).view(rows, steps, 3, heads, hd).unbind(2)   # [rows, T, H, hd]
            cache = kv[:, i]                                       # [slots, 2, H, max_len, hd], a view
            cache[:, 0].transpose(1, 2)[slots[:, None], pos] = k   # written through the view
            cache[:, 1].transpose(1, 2)[slots[:, None], pos] = v
            keys, values = cache[:, 0, :, :length][slots], cache[:, 1, :, :length][slots]   # [rows, H, keys, hd]
            att = (q.transpose(1, 2) @ keys.transpose(-1, -2)) * hd ** -0.5                  # [rows, H, T, keys]
            att = att.masked_fill(~visible, float("-inf")).softmax(-1)
            x = x + layer.proj((att @ values).transpose(1, 2).reshape(rows, steps, cfg.d_model))
            x = x + layer.mlp(x)
        return self.ln_f(x)

    def forward_tokens(self, tokens: torch.Tensor, kv: torch.Tensor, start: torch.Tensor,
                       slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [rows, T, vocab] of `tokens` [rows, T] (see `hidden`)."""
        return self.logits(self.hidden(tokens, kv, start, slots))

    def step_tokens(self, tokens: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                    slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One token per row, `tokens` [rows] at `positions` [rows]: the next logits [rows, vocab]."""
        return self.forward_tokens(tokens.reshape(-1, 1), kv, positions, slots)[:, 0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Training: logits [rows, T, vocab] of whole windows from position 0, no cache."""
        cfg = self.cfg
        rows, steps = tokens.shape
        x = self.tok(tokens) + self.pos(torch.arange(steps, device=tokens.device))
        for layer in self.layers:
            q, k, v = layer.qkv(layer.ln1(x)).view(rows, steps, 3, cfg.n_heads, cfg.head_dim).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + layer.proj(y.transpose(1, 2).reshape(rows, steps, cfg.d_model))
            x = x + layer.mlp(x)
        return self.logits(self.ln_f(x))


def training_ids(text: str) -> list[int]:
    """The training stream: each sentence's bytes followed by the end token, so that the model
    learns to end a sentence."""
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(text.split()))
    ids: list[int] = []
    for s in filter(None, sentences):
        ids += Tokenizer().encode(s) + [END]
    return ids


def build_gpt(cfg: GPTConfig, seed: int = 0, train_seconds: float = 0.0, text: Optional[str] = None,
              train_steps: Optional[int] = None) -> TinyGPTModule:
    """The model with deterministic random weights (from `seed`); trained on `text` (default: the
    text tgw ships, demo_corpus.CORPUS) for `train_steps` steps (deterministic), else for about
    `train_seconds` seconds. In eval mode, on the CPU."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = TinyGPTModule(cfg)
        if train_steps or train_seconds > 0:
            _train(module, text, train_steps, train_seconds)
    return module.eval()


def _train(module: TinyGPTModule, text: Optional[str], steps: Optional[int], seconds: float) -> None:
    if text is None:
        from .demo_corpus import CORPUS
        text = CORPUS
    data = torch.tensor(training_ids(text))
    window = min(64, module.cfg.max_len, len(data) - 1)
    if window < 2:
        raise ValueError("build_gpt: the training text is too short (it needs at least 3 bytes)")
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.01)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the same steps give the same weights whatever the machine's cores
    module.train()
    try:
        done, t0 = 0, time.monotonic()
        # small batches of 8 windows: many updates per byte learned (measured: 1,200 steps of 8
        # reach a lower loss than 800 of 32, in a third of the time)
        while (done < steps) if steps else (time.monotonic() - t0 < seconds or done == 0):
            at = torch.randint(len(data) - window, (8,)).tolist()
            x = torch.stack([data[a:a + window] for a in at])
            y = torch.stack([data[a + 1:a + window + 1] for a in at])
            loss = F.cross_entropy(module(x).reshape(-1, module.cfg.vocab), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            done += 1
    finally:
        torch.set_num_threads(threads)


WEIGHTS_FORMAT = "tgw-demo-gpt/1"


def save_gpt(module: TinyGPTModule, path: str) -> str:
    """torch.save of {format, config, state_dict}, atomically (a reader never sees half a file)."""
    tmp = os.path.join(os.path.dirname(path) or ".", f".tmp-{os.getpid()}-{os.path.basename(path)}")
    try:
        torch.save({"format": WEIGHTS_FORMAT, "config": asdict(module.cfg), "state_dict": module.state_dict()}, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load_gpt(path: str, device: Any = "cpu") -> TinyGPTModule:
    """The module `save_gpt` wrote, on `device`, in eval mode."""
    try:
        saved = torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"TinyGPT weights {path!r} not found (tgw.workers.demo_models writes them)") from None
    if not isinstance(saved, dict) or saved.get("format") != WEIGHTS_FORMAT:
        raise ValueError(f"{path!r} is not a TinyGPT weights file ({WEIGHTS_FORMAT}: save_gpt writes them)")
    module = TinyGPTModule(GPTConfig(**saved["config"]))
    module.load_state_dict(saved["state_dict"])
    return module.to(device).eval()


# ---- the exactness check ----------------------------------------------------------------------


def _prompt(module: TinyGPTModule, prompt_ids: Sequence[int]) -> torch.Tensor:
    cfg = module.cfg
    ids = [int(i) for i in prompt_ids]
    if not ids:
        raise ValueError("the prompt is empty: the model needs at least one token")
    if len(ids) > cfg.max_len:
        raise ValueError(f"the prompt has {len(ids)} tokens; the model's context holds {cfg.max_len}")
    if not all(0 <= i < cfg.vocab for i in ids):
        raise ValueError(f"token ids must lie in 0..{cfg.vocab - 1}")
    return torch.tensor([ids], device=module.tok.weight.device)


@torch.no_grad()
def reference_generate(module: TinyGPTModule, prompt_ids: Sequence[int], max_outputs: int,
                       end_tokens: Sequence[int] = ()) -> list[int]:
    """Greedy generation of ONE sequence in this process, with its own KV cache, in the module's
    dtype: up to `max_outputs` tokens, ending before an end token (not returned) or when the
    context (max_len positions) is full."""
    cfg, weight = module.cfg, module.tok.weight
    ids = _prompt(module, prompt_ids)
    kv = torch.zeros(1, *kv_shape(cfg), dtype=weight.dtype, device=weight.device)
    logits = module.forward_tokens(ids, kv, torch.zeros(1, dtype=torch.long, device=weight.device))[0, -1]
    out: list[int] = []
    pos = ids.shape[1]   # the position the next output takes
    while len(out) < max_outputs and pos < cfg.max_len:
        token = int(logits.argmax())
        if token in end_tokens:
            break
        out.append(token)
        pos += 1
        if len(out) < max_outputs and pos < cfg.max_len:
            logits = module.step_tokens(torch.tensor([token], device=weight.device), kv,
                                        torch.tensor([pos - 1], device=weight.device))[0]
    return out


def float64_reference(module: TinyGPTModule) -> TinyGPTModule:
    """A float64 copy of `module` on the CPU: the reference check_against_reference runs."""
    return copy.deepcopy(module).to("cpu", torch.float64).eval()


@dataclass
class Verdict:
    ok: bool
    compared: int                 # outputs compared with the reference's (all of them, unless a near tie)
    outputs: int                  # outputs tgw sent
    tie_at: Optional[int] = None  # the output position where the reference's top two were within the margin
    message: str = ""


@torch.no_grad()
def check_against_reference(reference: TinyGPTModule, prompt_ids: Sequence[int], outputs: Sequence[int], *,
                            end_tokens: Sequence[int] = (END,), reason: Optional[str] = None,
                            max_outputs: Optional[int] = None, margin: float = MARGIN) -> Verdict:
    """Does `outputs`, a greedy sequence tgw streamed for `prompt_ids`, equal the reference's?

    `reference` runs in float64 (a float32 module is copied to float64 first: pass
    `float64_reference(module)` to do that once). It reads prompt + outputs in one pass and, at
    each output position, requires tgw's token to be the reference's argmax, wherever the
    reference's top two logits are more than `margin` apart. At the first position where they
    are not (a near tie: float32 or batched rounding may pick either), the comparison of this
    sequence ends, successfully, and `tie_at` says where. Until that point the reference's
    argmax IS reference_generate's token (the same prefix), so this is reference_generate's
    check without re-running it per token. `reason` (GenerateEnd.reason) is checked too:
    stop_token needs the reference's next token to be an end token, max_outputs the count.
    """
    if reference.tok.weight.dtype != torch.float64:
        reference = float64_reference(reference)
    outputs = [int(t) for t in outputs]
    known = [int(t) for t in prompt_ids] + outputs
    if len(known) > reference.cfg.max_len:
        return Verdict(False, 0, len(outputs), message=f"{len(known)} positions: more than the model's "
                       f"max_len {reference.cfg.max_len}")
    check_end = reason == "stop_token"   # then the position after the last output is checked too
    ids = _prompt(reference, known if check_end else known[:-1] if outputs else known)
    kv = torch.zeros(1, *kv_shape(reference.cfg), dtype=torch.float64)
    logits = reference.forward_tokens(ids, kv, torch.zeros(1, dtype=torch.long))[0, len(known) - len(outputs) - 1:]
    for n in range(len(outputs) + check_end):
        top = logits[n].topk(2)
        best, gap = int(top.indices[0]), float(top.values[0] - top.values[1])
        if gap <= margin:
            return Verdict(True, n, len(outputs), tie_at=n,
                           message=f"near tie at output {n} (top two {gap:.2e} apart): compared up to there")
        if n < len(outputs) and outputs[n] != best:
            return Verdict(False, n, len(outputs), message=f"output {n}: tgw sent {outputs[n]}, the reference's "
                           f"argmax is {best} (its top two {gap:.2e} apart)")
        if n == len(outputs) and best not in end_tokens:
            return Verdict(False, n, len(outputs), message=f"tgw ended with stop_token after {n} outputs, the "
                           f"reference continues with {best}")
    if reason == "max_outputs" and max_outputs is not None and len(outputs) != max_outputs:
        return Verdict(False, len(outputs), len(outputs), message=f"reason max_outputs after {len(outputs)} "
                       f"outputs, of {max_outputs}")
    return Verdict(True, len(outputs), len(outputs))


# ---- the handler ------------------------------------------------------------------------------


class TinyGPT(Generator):
    """The tgw generator handler. options: weights (the file demo_models writes; relative to the
    handler's folder unless absolute). Input `prompt`: int64 token ids [P]; output `token`: int64
    []; state `kv`: float32 kv_shape(config) per slot. Returns logits: the worker samples."""

    def setup(self, context) -> None:
        weights = context.options.get("weights")
        if not weights:
            raise ValueError("TinyGPT needs options.weights: the file tgw.workers.demo_models writes "
                             "(torch.save of its config and state_dict)")
        path = weights if os.path.isabs(weights) else os.path.join(context.dir or ".", weights)
        self.module = load_gpt(path, context.device)
        self.cfg = self.module.cfg

    def _pool(self, batch) -> torch.Tensor:
        if "kv" not in batch.state:
            raise KeyError(f"TinyGPT keeps its KV cache in a state tensor named 'kv'; the config declares "
                           f"{sorted(batch.state)}")
        kv = batch.state["kv"]
        want = kv_shape(self.cfg)
        if list(kv.shape[1:]) != want or kv.dtype != self.module.tok.weight.dtype:
            raise ValueError(f"TinyGPT's state 'kv' must be {self.module.tok.weight.dtype} {want} per sequence "
                             f"(this model's config); the config declares {kv.dtype} {list(kv.shape[1:])}")
        return kv

    @torch.no_grad()
    def prefill(self, batch: PrefillBatch) -> dict[str, torch.Tensor]:
        kv, cfg = self._pool(batch), self.cfg
        prefix = batch.prefix.get("token")
        rows, seqs = [], []
        for r in range(batch.rows):
            ids = batch["prompt"][r].reshape(-1)
            if prefix is not None and prefix[r].numel():   # resumed after its worker died: continue after them
                ids = torch.cat([ids, prefix[r].reshape(-1).to(ids)])
            n = ids.numel()
            if n == 0:
                batch.fail(r, "the prompt is empty: TinyGPT needs at least one token")
            elif n > cfg.max_len:
                batch.fail(r, f"the prompt has {n} tokens; TinyGPT's context holds {cfg.max_len}")
            elif int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab:
                batch.fail(r, f"token ids must lie in 0..{cfg.vocab - 1}; this prompt has "
                              f"{int(ids.min() if ids.min() < 0 else ids.max())}")
            else:
                rows.append(r)
                seqs.append(ids)
        logits = torch.zeros(batch.rows, cfg.vocab, device=batch.device, dtype=kv.dtype)
        if rows:
            # one padded call for all rows: the padding's keys and values land past each prompt's
            # end, where nothing reads them before a step overwrites them
            tokens = nn.utils.rnn.pad_sequence(seqs, batch_first=True)
            last = torch.tensor([s.numel() - 1 for s in seqs], device=batch.device)
            at = torch.tensor(rows, device=batch.device)
            h = self.module.hidden(tokens, kv, torch.zeros_like(last), batch.slots[at])
            logits[at] = self.module.logits(h[torch.arange(len(rows), device=batch.device), last])
        return {"logits": logits}

    @torch.no_grad()
    def step(self, batch: StepBatch) -> dict[str, torch.Tensor]:
        kv, cfg = self._pool(batch), self.cfg
        positions = batch.positions.reshape(-1)
        over = (positions >= cfg.max_len).nonzero().flatten().tolist()
        for r in over:   # the config's max_length ends a sequence before this; a model's own limit still says so
            batch.fail(r, f"position {int(positions[r])} is past TinyGPT's context of {cfg.max_len}")
        if not over:
            return {"logits": self.module.step_tokens(batch["token"].reshape(-1), kv, positions, batch.slots)}
        logits = torch.zeros(batch.rows, cfg.vocab, device=batch.device, dtype=kv.dtype)
        keep = (positions < cfg.max_len).nonzero().flatten()
        if keep.numel():
            logits[keep] = self.module.step_tokens(batch["token"].reshape(-1)[keep], kv, positions[keep],
                                                   batch.slots[keep])
        return {"logits": logits}
