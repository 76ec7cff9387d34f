"""Out of GPU memory during a batch: free the cache, run the batch again in halves at request
boundaries (each half halved again while it still does not fit), and answer `OUT_OF_GPU_MEMORY`
only for a request that does not fit alone. The worker keeps serving; every event is counted
(Progress.gpu_ooms, sent in heartbeats), and the answered ones reach the breaker as failures.

TorchScript does not raise torch.cuda.OutOfMemoryError: its interpreter rethrows every error as
RuntimeError, with the allocator's message inside (pytorch issue 148642), so an out-of-memory is
known by that message too.
"""
from __future__ import annotations

from typing import Callable, Iterator, Union

import torch

MARKERS = ("CUDA out of memory", "CUDA error: out of memory", "CUDA driver error: out of memory")


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in MARKERS)


def oom_text(exc: BaseException) -> str:
    """The allocator's line ("CUDA out of memory. Tried to allocate ..."), not the interpreter's
    traceback around it."""
    text = str(exc)
    at = min((i for i in (text.find(m) for m in MARKERS) if i >= 0), default=0)
    return (text[at:].splitlines() or [type(exc).__name__])[0].strip()[:500]


Result = Union[list, BaseException]


def halves(compute: Callable[[int, int], list], lo: int, hi: int,
           on_oom: Callable[[str], None]) -> Iterator[tuple[int, int, Result]]:
    """Run requests lo..hi-1 (compute(lo, hi) -> outputs) split in halves after an out-of-memory,
    in order: (lo', hi', outputs or the exception that failed them). A request alone that still
    does not fit yields its out-of-memory exception; any other error fails its piece alone."""
    mid = (lo + hi) // 2
    for a, b in ((lo, mid), (mid, hi)):
        try:
            result: Result = compute(a, b)
        except Exception as exc:  # noqa: BLE001 - every failure is answered, this piece's only
            if is_oom(exc):
                on_oom(oom_text(exc))
                if b - a > 1:
                    yield from halves(compute, a, b, on_oom)
                    continue
            result = exc
        yield a, b, result
