"""`compress="auto"`: which tensors are worth lz4 - the one rule the client (its inputs) and the
broker (a reply's outputs, `Infer.compress_outputs: "auto"`) both apply.

A tensor is compressed when it is at least AUTO_MIN_BYTES and lz4 shrinks a sample of it (a few
stripes spread over its bytes) to at most AUTO_MAX_RATIO of its size; a compressed frame that
came out no smaller than the raw bytes is sent raw after all. The caller passes the compressor
(shm stays free of lz4). The figures behind the numbers are in bench/scenarios/compress.py
(`tgw-bench compress --rule`) and docs/PROTOCOL.md section 4:

* lz4 compress + decompress costs ~0.15-0.6 ms per MiB of raw bytes on data it shrinks below
  ~12 %, 0.8-1.4 ms/MiB at a ratio of 0.1-0.2 and 2.2-2.4 ms/MiB at 0.3-0.9 (a 2-core box);
* the link costs ~0.27 ms/MiB over ipc://, ~0.5 ms/MiB over tcp:// on loopback, ~1.8 ms/MiB
  over tcp:// with CURVE on loopback (the encryption bounds it; tgw's tcp is always CURVE) and
  ~8.4 ms/MiB over 1 Gb/s.

Compressing breaks even where the link costs more than lz4's cost / (1 - ratio): over CURVE
loopback up to a ratio of ~0.2, over 1 Gb/s up to ~0.7. AUTO_MAX_RATIO = 0.2 is never much worse
than raw and wins on every slower link. Over ipc it pays only below a ratio of ~0.03, saving
~0.1 ms/MiB while putting the inflate on the broker's one event-loop thread: the client's "auto"
compresses nothing on ipc:// (`for_address`). The sample (4 stripes of 8 KiB) costs 7-60 us;
AUTO_MIN_BYTES = 256 KiB keeps that under ~15 % of the tensor's transfer on the fastest tcp link.
"""
from __future__ import annotations

from typing import Callable, Union

AUTO_MIN_BYTES = 256 << 10     # smaller tensors are sent raw
AUTO_MAX_RATIO = 0.2           # compressed sample / sample, at most
SAMPLE_STRIPES = 4             # stripes of the tensor lz4 is tried on, spread evenly over it
STRIPE_BYTES = 8 << 10

Compress = Union[bool, str]    # True, False or "auto"


def sample(data: memoryview) -> list[memoryview]:
    """SAMPLE_STRIPES stripes of STRIPE_BYTES spread over `data` (first and last included), or
    all of it when it is not larger than that."""
    n = data.nbytes
    if n <= SAMPLE_STRIPES * STRIPE_BYTES:
        return [data]
    step = (n - STRIPE_BYTES) // (SAMPLE_STRIPES - 1)
    return [data[i * step:i * step + STRIPE_BYTES] for i in range(SAMPLE_STRIPES)]


def worth_compressing(data: memoryview, compressed_len: Callable[[memoryview], int]) -> bool:
    """The auto rule for one tensor's raw bytes (a flat byte memoryview); `compressed_len(part)`
    is the lz4 frame's length for `part` (e.g. `lambda b: len(lz4.frame.compress(b))`)."""
    if data.nbytes < AUTO_MIN_BYTES:
        return False
    parts = sample(data)
    raw = sum(p.nbytes for p in parts)
    return sum(compressed_len(p) for p in parts) <= AUTO_MAX_RATIO * raw


def for_address(compress: Compress, address: str) -> Compress:
    """What a client asks for on the link to `address`: "auto" is off (False) over ipc://, where
    compressing costs more than the socket copy it saves; anything else as given."""
    if compress == "auto" and not address.startswith("tcp://"):
        return False
    return compress
