"""A request's outputs as its reply carries them: frames, lz4-compressed when it asked."""
from __future__ import annotations

import lz4.frame

from tgw.shm.wire import TensorMeta

from .pending import Pending


def reply_tensors(p: Pending, views: dict) -> tuple[list[TensorMeta], list]:
    """The reply's TensorMetas and frames for `p`'s outputs (`views`: name -> (array, bytes view)
    of its rows in the output arena; the frames may be those views: the sender copies them)."""
    if p.compress:
        payload = [lz4.frame.compress(views[name][1]) for name in p.outputs]
    else:
        payload = [views[name][1] for name in p.outputs]
    metas = [TensorMeta(name=name, dtype=views[name][0].dtype, shape=[p.rows, *views[name][0].shape[1:]],
                        compression="lz4" if p.compress else None) for name in p.outputs]
    return metas, payload
