"""What the batcher's tests share (test_batcher.py, test_batcher_budgets.py):
requests of given rows, sizes and deadlines."""
from __future__ import annotations

from tgw.broker.sched.batcher import Pending

BIG = 1 << 30   # a byte budget nothing reaches


_ids = iter(range(1, 10 ** 9))


def req(model="m", rows=1, version="1", shape_key=(), nbytes=(16,), deadline=None, clock=None,
        req_id=None, out=None) -> Pending:
    """`nbytes` and `out` (None: output size unknown until computed) are bytes per row."""
    now = clock() if clock else 1000.0
    return Pending(client=b"c", req_id=req_id if req_id is not None else next(_ids), model=model,
                   version=version, rows=rows, shape_key=shape_key,
                   tensors=[bytes(n * rows) for n in nbytes], outputs=["y"],
                   deadline=now + 30 if deadline is None else deadline,
                   out_nbytes=None if out is None else [n * rows for n in out])


def ids(batch) -> list[int]:
    return [p.req_id for p in batch]
