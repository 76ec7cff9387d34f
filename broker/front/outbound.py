"""A request's outputs as its reply carries them: frames, lz4-compressed when it asked (all of
them for `compress_outputs: true`; for "auto", those tgw.shm.compression's rule picks, the
rule the client applies to its inputs)."""
from __future__ import annotations

import lz4.frame

from tgw.shm.compression import worth_compressing
from tgw.shm.wire import TensorMeta

from tgw.broker.state.pending import Pending


def _lz4_len(part: memoryview) -> int:
    return len(lz4.frame.compress(part))


def packed(compress, raw) -> tuple[object, str | None]:
    """One output's frame and its `compression`: `raw` (a bytes view) as it is, or its lz4 frame."""
    if compress is True:
        return lz4.frame.compress(raw), "lz4"
    if compress == "auto":
        view = memoryview(raw).cast("B") if not isinstance(raw, memoryview) or raw.format != "B" else raw
        if worth_compressing(view, _lz4_len):
            frame = lz4.frame.compress(view)
            if len(frame) < view.nbytes:
                return frame, "lz4"
    return raw, None


def reply_tensors(p: Pending, views: dict) -> tuple[list[TensorMeta], list]:
    """The reply's TensorMetas and frames for `p`'s outputs (`views`: name -> (array, bytes view)
    of its rows in the output arena; the frames may be those views: the sender copies them)."""
    metas, payload = [], []
    for name in p.outputs:
        arr, raw = views[name]
        frame, compression = packed(p.compress, raw) if p.compress else (raw, None)
        metas.append(TensorMeta(name=name, dtype=arr.dtype, shape=[p.rows, *arr.shape[1:]], compression=compression))
        payload.append(frame)
    return metas, payload
