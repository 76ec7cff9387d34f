"""bfloat16 without ml_dtypes: float32 <-> bfloat16 bit patterns (uint16) in numpy, for the
client (float32 sent at wire_dtype bfloat16) and the broker (BF16 JSON over HTTP), neither of
which may need torch. A bfloat16 is the top half of a float32."""
from __future__ import annotations

import numpy as np


def to_bfloat16_bits(arr: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest, ties to even (as torch
    does); infinities stay, values past bfloat16's largest round to infinity, NaN stays NaN
    (quiet, sign kept)."""
    u = np.ascontiguousarray(arr, dtype="<f4").view("<u4")
    rounded = u >> 16        # in place from here: a quarter of the time of the plain expression
    rounded &= 1
    rounded += 0x7FFF
    rounded += u             # wraps only for NaNs (set below)
    rounded >>= 16
    bits = rounded.astype("<u2")
    nan = np.isnan(u.view("<f4"))
    if nan.any():
        bits[nan] = ((u[nan] >> 16) | 0x0040).astype("<u2")
    return bits


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (np.asarray(bits, dtype="<u2").astype("<u4") << 16).view("<f4")
