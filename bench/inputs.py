"""Random request inputs generated from a model's declaration (`Client.models()` entries).

Variable dims (-1) get a fixed length (`var_len`, 16 by default) so every request of a run has
the same size. Inputs are generated once per generator thread and reused: the generator must
not spend its CPU on random numbers while it measures the server.
"""
from __future__ import annotations

from typing import Any

import numpy as np

VAR_LEN = 16


def input_shape(decl: dict[str, Any], batch: int, var_len: int = VAR_LEN) -> tuple[int, ...]:
    return (batch, *[var_len if d == -1 else int(d) for d in decl["shape"]])


def random_tensor(dtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(dt, np.integer):
        hi = min(np.iinfo(dt).max, 1000)  # token-id-like range; models map ids themselves
        return rng.integers(0, hi, size=shape, dtype=dt)
    return rng.standard_normal(size=shape).astype(dt)


GENERATORS = ("random", "zeros")


def make_inputs(meta: dict[str, Any], batch: int = 1, seed: int = 0,
                var_len: int = VAR_LEN, kind: str = "random") -> dict[str, np.ndarray]:
    """One request's inputs: {input name: array with a leading batch dim}.

    kind "random": standard normal floats / integers in [0, 1000); "zeros": all zeros."""
    if kind not in GENERATORS:
        raise ValueError(f"input generator must be one of {GENERATORS}, got {kind!r}")
    rng = np.random.default_rng(seed)
    if kind == "zeros":
        return {d["name"]: np.zeros(input_shape(d, batch, var_len), dtype=d["dtype"]) for d in meta["inputs"]}
    return {d["name"]: random_tensor(d["dtype"], input_shape(d, batch, var_len), rng)
            for d in meta["inputs"]}


def request_bytes(meta: dict[str, Any], batch: int = 1, var_len: int = VAR_LEN) -> int:
    """Payload bytes of one request (tensor bytes only)."""
    return sum(int(np.prod(input_shape(d, batch, var_len))) * np.dtype(d["dtype"]).itemsize
               for d in meta["inputs"])


def reply_bytes(meta: dict[str, Any], batch: int = 1, var_len: int = VAR_LEN) -> int:
    return sum(int(np.prod(input_shape(d, batch, var_len))) * np.dtype(d["dtype"]).itemsize
               for d in meta["outputs"])


def find_model(models: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for m in models:
        if m["name"] == name:
            return m
    raise LookupError(f"model {name!r} is not served; served: {', '.join(m['name'] for m in models)}")
