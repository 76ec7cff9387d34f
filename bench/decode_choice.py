"""Which JPEG decoder the demo's DecodeImage stage uses: each decoder in
tgw.workers.demo_vision.DECODERS (Pillow, Pillow in draft mode, simplejpeg, torchvision when it
imports) timed doing decode + resize to 64x64 of every demo image, one thread, best of rounds.

    python -m tgw.bench.decode_choice [--seconds 1] [--json bench/results/decode_choice.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time

import numpy as np


def measure(seconds: float, rounds: int = 3) -> dict:
    import torch
    from tgw.workers.demo_vision import DECODERS, IMAGE_SIZES, write_images
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        images = [open(p, "rb").read() for p in write_images(folder)]
    out = {}
    for name, decode in DECODERS.items():
        try:
            decode(images[0])
        except ImportError as exc:
            out[name] = {"error": f"not importable: {exc}"}
            continue
        best = []
        for data in images:
            per_round = []
            for _ in range(rounds):
                n, t0 = 0, time.perf_counter()
                while (elapsed := time.perf_counter() - t0) < seconds / rounds / len(images) or n < 5:
                    decode(data)
                    n += 1
                per_round.append(elapsed / n * 1e6)
            best.append(min(per_round))
        out[name] = {"us_per_image": dict(zip([f"{w}x{h}" for w, h in IMAGE_SIZES], map(round, best))),
                     "mean_us": round(float(np.mean(best)), 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tgw.bench.decode_choice", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="seconds per decoder (default 1)")
    ap.add_argument("--json", help="write the result here")
    a = ap.parse_args(argv)
    results = measure(a.seconds)
    timed = {k: v["mean_us"] for k, v in results.items() if "mean_us" in v}
    fastest = min(timed, key=timed.get)
    for name, r in results.items():
        print(f"{name:<14} " + (f"{r['mean_us']:8.1f} us per image (decode + resize to 64x64)" if "mean_us" in r
                                 else r["error"]))
    print(f"fastest: {fastest}")
    if a.json:
        load = os.getloadavg()
        doc = {"command": " ".join(["python -m tgw.bench.decode_choice", *map(shlex.quote, argv or sys.argv[1:])]),
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cores": os.cpu_count(), "load_avg_1m": load[0],
               "decoders": results, "fastest": fastest}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
