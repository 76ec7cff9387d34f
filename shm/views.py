"""numpy views of ring blocks: no copy, the view borrows the segment's memory."""
from __future__ import annotations

import numpy as np

from .wire import BlockTensor


def block_view(buf: memoryview, t: BlockTensor) -> np.ndarray:
    """The array a BlockTensor describes; keep it short-lived, it pins the mapping."""
    return np.frombuffer(buf, dtype=np.dtype(t.dtype), count=t.nbytes // np.dtype(t.dtype).itemsize,
                         offset=t.offset).reshape(t.shape)
