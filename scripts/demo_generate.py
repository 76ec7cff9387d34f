"""Demo generation: prompts streamed from the demo's generator tiny-gpt over the native client,
each checked against the same model's greedy generation run in this process.

Half the prompts stream from threads sharing one Client (`Client.generate`: an iterator of token
ids), the other half from coroutines sharing one AsyncClient (`AsyncClient.generate`: an async
iterator), all at once, so the worker's step loop batches them; the first few completions are
printed decoded. Each sequence is checked with tgw.workers.demo_generator.check_against_reference:
the float64 reference must pick tgw's every token wherever its top two logits are more than
MARGIN apart; at a near tie the comparison of that sequence stops there (counted, never a
mismatch hidden by a tolerance). Used by demo_traffic.py (scripts/demo.sh); runs on its own too:

    .venv/bin/python scripts/demo_generate.py --address ipc:///tmp/x/tgw.sock --models-dir ~/.cache/tgw/demo
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time

import numpy as np

from tgw.client import AsyncClient, Client, TgwError
from tgw.workers.demo_tokenizer import Tokenizer

MODEL = "tiny-gpt"
MAX_OUTPUTS = 80
SHOWN = 6   # completions printed per face
PROMPTS = [
    "The server ", "A model ", "When a picture ", "Batching ", "The weather ", "Good software ",
    "A tokenizer ", "The broker ", "A pipeline is ", "Tests wait ", "The river ", "Errors name ",
    "The worker runs ", "A deadline ", "Common words ", "In the afternoon ",
]


def stream_sync(address: str, prompts: list[str]) -> list[dict]:
    """Each prompt from its own thread, all sharing one Client."""
    tok, results = Tokenizer(), [None] * len(prompts)

    def one(c: Client, i: int) -> None:
        t0, tokens = time.perf_counter(), []
        try:
            stream = c.generate(MODEL, {"prompt": np.array(tok.encode(prompts[i]), dtype=np.int64)},
                                max_outputs=MAX_OUTPUTS, timeout=120)
            for token in stream:
                tokens.append(token)
            results[i] = {"tokens": tokens, "final": stream.final, "seconds": time.perf_counter() - t0}
        except TgwError as err:
            results[i] = {"tokens": tokens, "error": f"{err.code.name}: {err}"}
        except Exception as exc:   # anything else still ends as this stream's error, not a lost row
            results[i] = {"tokens": tokens, "error": f"{type(exc).__name__}: {exc}"}

    with Client(address) as c:
        threads = [threading.Thread(target=one, args=(c, i)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return results


def stream_async(address: str, prompts: list[str]) -> list[dict]:
    """Each prompt from its own coroutine, all sharing one AsyncClient (one socket)."""
    tok = Tokenizer()

    async def main() -> list[dict]:
        async with AsyncClient(address) as c:
            async def one(prompt: str) -> dict:
                t0, tokens = time.perf_counter(), []
                try:
                    stream = c.generate(MODEL, {"prompt": np.array(tok.encode(prompt), dtype=np.int64)},
                                        max_outputs=MAX_OUTPUTS, timeout=120)
                    async for token in stream:
                        tokens.append(token)
                    return {"tokens": tokens, "final": stream.final, "seconds": time.perf_counter() - t0}
                except TgwError as err:
                    return {"tokens": tokens, "error": f"{err.code.name}: {err}"}
                except Exception as exc:
                    return {"tokens": tokens, "error": f"{type(exc).__name__}: {exc}"}
            return await asyncio.gather(*(one(p) for p in prompts))
    return asyncio.run(main())


def reference_model(models_dir: str):
    """The served weights as a float64 module in this process."""
    from tgw.workers.demo_generator import float64_reference, load_gpt
    from tgw.workers.demo_models import GPT_FILE   # torch: only after the timed traffic
    return float64_reference(load_gpt(os.path.join(models_dir, GPT_FILE)))


def check(reference, prompts: list[str], results: list[dict]) -> None:
    """Adds each result's verdict (tgw.workers.demo_generator.Verdict) against the float64 reference."""
    from tgw.workers.demo_generator import END, check_against_reference
    tok = Tokenizer()
    for prompt, r in zip(prompts, results):
        if "final" in r:
            r["verdict"] = check_against_reference(reference, tok.encode(prompt), r["tokens"], end_tokens=(END,),
                                                   reason=r["final"].reason, max_outputs=MAX_OUTPUTS)


def run(address: str, models_dir: str) -> tuple[list[tuple], bool]:
    """Streams every prompt (half sync, half async, at once), checks them, prints some; returns the
    summary rows (face, streams, errors, mismatches, near ties, outputs, first output p50 ms,
    outputs/s) and whether anything failed."""
    half = len(PROMPTS) // 2
    faces = {"native": PROMPTS[:half], "async": PROMPTS[half:]}
    got: dict[str, list] = {}
    t0 = time.perf_counter()
    threads = [threading.Thread(target=lambda: got.__setitem__("native", stream_sync(address, faces["native"])))]
    threads[0].start()
    got["async"] = stream_async(address, faces["async"])
    threads[0].join()
    elapsed = time.perf_counter() - t0
    tok, rows, failed, reference = Tokenizer(), [], False, reference_model(models_dir)
    print(f"\n{MODEL}: {len(PROMPTS)} prompts streamed at once in {elapsed:.2f} s, greedy, up to {MAX_OUTPUTS} "
          f"tokens each (the end token ends a sentence):")
    for face, prompts in faces.items():
        results = got[face]
        check(reference, prompts, results)
        for prompt, r in list(zip(prompts, results))[:SHOWN]:
            end = r["final"].reason if "final" in r else r["error"]
            print(f"  {face:<6} {prompt + tok.decode(r['tokens'])!r}  ({len(r['tokens'])} tokens, {end})")
        row, bad = summary(face, results, [r["final"].first_output_ms for r in results if "final" in r], elapsed)
        rows.append(row)
        failed |= bad
    return rows, failed


def summary(face: str, results: list[dict], firsts: list[float], elapsed: float) -> tuple[tuple, bool]:
    """One face's row for `show` (face, streams, errors, mismatches, near ties, outputs, first
    output p50 ms, outputs/s) from its checked results, its errors printed; and whether it failed."""
    errors = [r["error"] for r in results if "error" in r]
    bad = [r["verdict"].message for r in results if "verdict" in r and not r["verdict"].ok]
    ties = sum(1 for r in results if "verdict" in r and r["verdict"].tie_at is not None)
    outputs = sum(len(r["tokens"]) for r in results)
    p50 = float(np.percentile(firsts, 50)) if firsts else float("nan")
    for line in errors + bad:
        print(f"  {face}: {line}", file=sys.stderr)
    return (face, len(results), len(errors), len(bad), ties, outputs, p50, outputs / elapsed), bool(errors or bad)


def show(rows: list[tuple]) -> None:
    print(f"\n{'model':<10} {'face':<7} {'streams':>7} {'errors':>6} {'mismatches':>10} {'near ties':>9} "
          f"{'outputs':>7} {'1st p50 ms':>10} {'outputs/s':>9}")
    for face, n, e, bad, ties, outputs, p50, rate in rows:
        print(f"{MODEL:<10} {face:<7} {n:>7} {e:>6} {bad:>10} {ties:>9} {outputs:>7} {p50:>10.1f} {rate:>9.0f}")
    print("(each stream checked against the model's greedy run in-process in float64: every token where the "
          "reference's top two logits are apart by more than the margin; a near tie ends that sequence's "
          "comparison, counted)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", required=True)
    ap.add_argument("--models-dir", required=True)
    args = ap.parse_args()
    rows, failed = run(args.address, args.models_dir)
    show(rows)
    print("RESULT:", "FAIL" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
