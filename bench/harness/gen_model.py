"""The generation benchmark's model and its in-process floor (`tgw-bench generate`).

Every system of the benchmark serves the same decoder: the embedded demo's GPT
(`tgw.workers.demo_generator`), sized by `DIMS` (full) or `QUICK_DIMS`, its random weights built
from a seed and saved once to a file that each server loads. `prefill` and `steps` here are the
model's own KV-cache loop (greedy), shared by the floor, the Flask and the LitServe baselines;
`next_token` is the one-shot form without a cache (the tgw one-shot row's stage).

The floor (`measure_floor`) runs in a spawned process with one torch thread, like each tgw worker:
all N sequences in one static batch - the prompts prefilled in one padded call (each row's first
output), then 63 batched steps for the other outputs - and times the prefill (per prompt, and of
one prompt alone) and one step at N rows.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import sys
import time
from typing import Any, Callable

import numpy as np

OUTPUTS = 64        # outputs per request
# one step at 64 rows costs >= 10 ms with one torch thread on the 2-core box the results were taken
# on (20 ms measured while sizing it, 4 layers gave 9.7 ms on a quiet box; each run reports its
# own floor's step time)
DIMS = {"vocab": 512, "d_model": 128, "n_layers": 6, "n_heads": 4, "max_len": 160}
QUICK_DIMS = {"vocab": 64, "d_model": 16, "n_layers": 1, "n_heads": 2, "max_len": 128}
PROMPT_LENGTHS = (8, 64)   # uniform, inclusive; a prompt + OUTPUTS - 1 positions must fit max_len


def stream_levels(text: str) -> list[int] | None:
    """`--streams`: its comma-separated counts, sorted, each 1..64 (the generator's slots); None
    (with the reason printed) when it is not that."""
    try:
        levels = sorted({int(x) for x in text.split(",") if x})
        if levels and 1 <= min(levels) and max(levels) <= 64:
            return levels
    except ValueError:
        pass
    print(f"--streams: comma-separated counts in 1..64 (the generator's slots), got {text!r}", file=sys.stderr)
    return None


def config(dims: dict[str, int]):
    from tgw.workers.demo_generator import GPTConfig
    return GPTConfig(**dims)


def generator_entry(name: str, weights: str, cfg, max_outputs: int, tokenizer: str = "") -> dict[str, Any]:
    """The benchmarks' generator model entry: the TinyGPT handler on `weights` (a `cfg` model),
    64 slots a worker, no end token (every request runs to its max_outputs); with `tokenizer`
    (generator.tokenizer, e.g. "bytes") it is an OpenAI model too (docs/OPENAI.md)."""
    from tgw.workers.demo_generator import kv_shape
    return {"name": name, "versions": [{"version": "1", "handler": "tgw.workers.demo_generator:TinyGPT"}],
            "options": {"weights": weights},
            "inputs": [{"name": "prompt", "dtype": "int64", "shape": [-1]}],
            "outputs": [{"name": "token", "dtype": "int64", "shape": []}],
            "max_batch_size": 64, "max_queue": 4096, "timeout_ms": 600_000,
            "generator": {"state": [{"name": "kv", "dtype": "float32", "shape": kv_shape(cfg)}],
                          "max_sequences": 64, "max_length": cfg.max_len, "length_input": "prompt",
                          "max_outputs": max_outputs, **({"tokenizer": tokenizer} if tokenizer else {})}}


def save_weights(dims: dict[str, int], seed: int, path: str) -> str:
    """The model of `dims` with random weights from `seed`, saved where the TinyGPT handler loads it."""
    from tgw.workers.demo_generator import build_gpt, save_gpt
    return save_gpt(build_gpt(config(dims), seed), path)


def load(path: str):
    """The module saved by save_weights (eval mode, CPU)."""
    from tgw.workers.demo_generator import load_gpt
    return load_gpt(path)


def prompts(n: int, seed: int, vocab: int, lengths: tuple[int, int] = PROMPT_LENGTHS) -> list[list[int]]:
    """n prompts of seeded, varied lengths."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(lengths[0], lengths[1] + 1))).tolist() for _ in range(n)]


def kv_pool(module, rows: int):
    import torch
    from tgw.workers.demo_generator import kv_shape
    return torch.zeros(rows, *kv_shape(module.cfg))


def prefill(module, batch: list[list[int]], kv) -> list[int]:
    """Every prompt's cache written into kv[row] in one padded call, as the TinyGPT handler does;
    each row's first output (greedy)."""
    import torch
    tokens = torch.nn.utils.rnn.pad_sequence([torch.tensor(p) for p in batch], batch_first=True)
    last = torch.tensor([len(p) - 1 for p in batch])
    h = module.hidden(tokens, kv, torch.zeros_like(last), torch.arange(len(batch)))
    return module.logits(h[torch.arange(len(batch)), last]).argmax(-1).tolist()


def step(module, last, kv, positions):
    """One batched step: each row's last output (long [rows]) at its position (long [rows]) -> the
    next outputs (long [rows]); kv[row] updated in place."""
    return module.step_tokens(last, kv, positions).argmax(-1)


def generate_batch(module, batch: list[list[int]], kv, n: int = OUTPUTS) -> tuple[list[list[int]], float, float]:
    """The static batch: every prompt prefilled, then n - 1 batched steps. Returns each row's
    outputs, the prefill seconds (all prompts) and the steps' seconds."""
    import torch
    t0 = time.perf_counter()
    first = prefill(module, batch, kv)
    t1 = time.perf_counter()
    out = [first]
    last, positions = torch.tensor(first), torch.tensor([len(p) for p in batch])
    for _ in range(n - 1):
        last = step(module, last, kv[:len(batch)], positions)
        positions += 1
        out.append(last.tolist())
    t2 = time.perf_counter()
    return [list(r) for r in zip(*out)], t1 - t0, t2 - t1


def _floor(weights: str, streams: list[int], prompt_list: list[list[int]], rounds: int, results) -> None:
    import torch
    torch.set_num_threads(1)
    module = load(weights)
    kv = kv_pool(module, max(streams))
    res: dict[str, Any] = {"torch": torch.__version__, "threads": 1, "levels": {}}
    with torch.inference_mode():
        generate_batch(module, prompt_list[:max(streams)], kv, 4)   # warm-up
        alone = []
        for p in prompt_list[:32]:   # one prompt prefilled alone: what a newcomer's prefill costs
            t0 = time.perf_counter()
            prefill(module, [p], kv)
            alone.append(time.perf_counter() - t0)
        res["prefill_one_ms"] = 1e3 * float(np.median(alone))
        for n in streams:
            walls, prefills, step_s = [], [], []
            for r in range(rounds):
                batch = [prompt_list[(r * n + i) % len(prompt_list)] for i in range(n)]
                t0 = time.perf_counter()
                _, pre, steps_s = generate_batch(module, batch, kv)
                walls.append(time.perf_counter() - t0)
                prefills.append(pre)
                step_s.append(steps_s / (OUTPUTS - 1))
            best = int(np.argmin(walls))
            res["levels"][n] = {"outputs_per_s": n * OUTPUTS / walls[best], "wall_s": walls[best],
                                "prefill_ms": 1e3 * float(np.median(prefills)),
                                "step_ms": 1e3 * float(np.median(step_s)), "rounds": rounds}
    results.put(res)


def measure_floor(weights: str, streams: list[int], prompt_list: list[list[int]], rounds: int) -> dict[str, Any]:
    """The floor at each stream count: outputs/s (the best of `rounds` static batches), the median
    prefill of the batch's prompts and step at that many rows; and one prompt's prefill alone.
    In a spawned process with one torch thread."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=_floor, args=(weights, streams, prompt_list, rounds, results), daemon=True)
    p.start()
    try:
        while True:
            try:
                return results.get(timeout=1)
            except queue.Empty:
                if p.exitcode is not None:
                    raise RuntimeError(f"the floor process exited with {p.exitcode}") from None
    finally:
        p.join(10)
        if p.is_alive():
            p.terminate()   # by PID: only the process started here


def _split_copy(weights: str, streams: list[int], prompt_list: list[list[int]], rounds: int, procs: int, index: int,
                barrier, results) -> None:
    import torch
    torch.set_num_threads(1)
    module = load(weights)
    kv = kv_pool(module, -(-max(streams) // procs))
    walls: dict[int, list[float]] = {}
    with torch.inference_mode():
        generate_batch(module, prompt_list[:2], kv, 4)   # warm-up
        for n in streams:
            share = range(index, n, procs)   # this copy's sequences of the level
            for r in range(rounds):
                batch = [prompt_list[(r * n + i) % len(prompt_list)] for i in share]
                barrier.wait()
                t0 = time.perf_counter()
                if batch:
                    generate_batch(module, batch, kv)
                walls.setdefault(n, []).append(time.perf_counter() - t0)
    results.put(walls)


def measure_split_floor(weights: str, streams: list[int], prompt_list: list[list[int]], rounds: int,
                        procs: int) -> dict[str, Any]:
    """The floor on `procs` processes at once (one torch thread each, as many as the served
    systems' workers): each level's sequences dealt among them, each copy a static batch of its
    share; outputs/s = all outputs over the slowest copy's time, the best of `rounds`."""
    ctx = mp.get_context("spawn")
    results, barrier = ctx.Queue(), ctx.Barrier(procs, timeout=300)
    copies = [ctx.Process(target=_split_copy, args=(weights, streams, prompt_list, rounds, procs, i, barrier, results),
                          daemon=True) for i in range(procs)]
    out: list[dict] = []
    try:
        for c in copies:
            c.start()
        while len(out) < procs:
            try:
                out.append(results.get(timeout=1))
            except queue.Empty:
                if any(c.exitcode not in (None, 0) for c in copies):
                    raise RuntimeError(f"a floor copy exited with {[c.exitcode for c in copies]}") from None
    finally:
        for c in copies:
            c.join(10)
            if c.is_alive():
                c.terminate()   # by PID: only the copies started here
    levels = {}
    for n in streams:
        wall = min(max(w[n][r] for w in out) for r in range(rounds))
        levels[n] = {"outputs_per_s": n * OUTPUTS / wall, "wall_s": wall, "procs": procs, "rounds": rounds}
    return {"procs": procs, "threads": 1, "levels": levels}


def checker(module) -> Callable[[list[int], list[int]], str]:
    """check(prompt, outputs): "" when `outputs` are the greedy continuation of `prompt`, else why -
    the demo's exactness check (a float64 reference; a near tie between its top two ends the
    comparison there, as batched float32 rounding may pick either)."""
    from tgw.workers.demo_generator import check_against_reference, float64_reference
    ref = float64_reference(module)

    def check(prompt: list[int], outputs: list[int]) -> str:
        v = check_against_reference(ref, prompt, outputs, end_tokens=(), reason="max_outputs", max_outputs=OUTPUTS)
        return "" if v.ok else v.message
    return check
