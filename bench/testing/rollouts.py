"""Shadow and guarded-rollout scenarios (docs/ROLLOUT.md) against a running broker: the scorer
models, closed-loop callers whose every answer is checked against the serving version, and a
wait for a guard's decision. tests/process/test_rollouts.py checks their rules; the retired
shadow benchmark and rollout walkthrough measured with them (bench/results/RETIRED.md).

The scorer: y = x @ W + b, 16 inputs, 10 class scores, fixed weights. Its kinds:
  base   - version 1, what callers must be answered with;
  close  - base + 1e-6 on every score (a harmless retrain: promoted);
  flip   - base, except rows with x[0] > 1.6449 (5 % of standard normal inputs), whose top class
           is pushed to the bottom (top-1 flips on 5 %: rolled back);
  broken - raises on any input that is not all zeros (warm-up passes, callers fail).
"""
from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np

from tgw.client import Client
from tgw.shm.errors import TgwError

FEATURES, CLASSES = 16, 10
FLIP_AT = 1.6449   # P(z > 1.6449) = 5 % for a standard normal z
CLOSE = 1e-6


def weights() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(29)
    return rng.standard_normal((FEATURES, CLASSES)).astype(np.float32), rng.standard_normal(CLASSES).astype(np.float32)


def expected(x: np.ndarray) -> np.ndarray:
    """The base version's answer, computed here."""
    w, b = weights()
    return x @ w + b


def save_scorer(path: str, kind: str = "base") -> str:
    import torch

    w, b = weights()

    class Scorer(torch.nn.Module):
        def __init__(self, shift: float, flip: bool, broken: bool):
            super().__init__()
            self.register_buffer("w", torch.from_numpy(w.copy()))
            self.register_buffer("b", torch.from_numpy(b.copy()))
            self.shift, self.flip, self.broken, self.flip_at = shift, flip, broken, FLIP_AT

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.broken and bool(x.abs().sum() > 0):
                raise RuntimeError("this version is broken")
            y = x @ self.w + self.b + self.shift
            if self.flip:
                top = torch.nn.functional.one_hot(y.argmax(dim=1), y.shape[1]).to(y.dtype)
                y = torch.where((x[:, 0] > self.flip_at).unsqueeze(1), y - 1000.0 * top, y)
            return y

    torch.jit.save(torch.jit.script(Scorer(CLOSE if kind == "close" else 0.0, kind == "flip", kind == "broken")),
                   path)
    return path


def scorer_decl(name: str, path: str, **extra) -> dict:
    return {"name": name, "versions": [{"version": "1", "path": path}], "max_batch_size": 32,
            "inputs": [{"name": "x", "dtype": "float32", "shape": [FEATURES]}],
            "outputs": [{"name": "y", "dtype": "float32", "shape": [CLASSES]}], **extra}


class Callers:
    """`n` closed-loop callers of `model` until stop(): every answer compared with the base
    version's (within `tolerance`, which a `close` version keeps); latencies kept with their
    end time, so a window (before a load, after it) can be cut out later."""

    def __init__(self, address: str, model: str, n: int, tolerance: float = 1e-4, seed: int = 0):
        self.address, self.model, self.tolerance = address, model, tolerance
        self.tally: Counter = Counter()
        self.latencies: list[tuple[float, float]] = []   # (end, seconds)
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(seed + i,), daemon=True) for i in range(n)]

    def start(self) -> "Callers":
        for t in self.threads:
            t.start()
        return self

    def _run(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with Client(self.address) as c:
            while not self._stop.is_set():
                x = rng.standard_normal((1, FEATURES)).astype(np.float32)
                t0 = time.perf_counter()
                try:
                    y = c.infer(self.model, {"x": x}, timeout=10.0)["y"]
                except TgwError as err:
                    with self.lock:
                        self.tally[f"error {err.code.value}"] += 1
                    continue
                t1 = time.perf_counter()
                right = np.allclose(y, expected(x), rtol=0, atol=self.tolerance)
                with self.lock:
                    self.tally["ok" if right else "wrong"] += 1
                    self.latencies.append((t1, t1 - t0))

    def answered(self) -> int:
        with self.lock:
            return self.tally["ok"] + self.tally["wrong"]

    def stop(self) -> dict:
        self._stop.set()
        for t in self.threads:
            t.join(60)
        return dict(self.tally)

    def p99_ms(self, since: float = 0.0, until: float = float("inf")) -> float | None:
        with self.lock:
            window = [s for end, s in self.latencies if since <= end < until]
        return round(float(np.percentile(window, 99)) * 1000, 3) if window else None


def decision(address: str, model: str, version: str, timeout_s: float = 120.0) -> dict:
    """Wait for the guard's decision on model:version and for it to be carried out (the version
    promoted to take unnamed requests, or gone); the decision record."""
    deadline = time.monotonic() + timeout_s
    with Client(address) as c:
        while time.monotonic() < deadline:
            status = c.status()
            made = [d for d in status["rollouts"].get("decisions", [])
                    if d["model"] == model and d["version"] == version]
            if made:
                m = status["models"][model]
                done = m["default_version"] == version if made[-1]["decision"] == "promote" else \
                    version not in m["versions"]
                if done:
                    return made[-1]
            time.sleep(0.05)
    raise TimeoutError(f"no decision carried out on {model}:{version} within {timeout_s} s")
