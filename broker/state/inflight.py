"""One batch in flight on a worker, as the broker keeps it: its requests in the worker's order,
and withdrawals from it.

A request withdrawn while its batch is on the worker (nobody waits for it) leaves the batch's
`requests` at once and keeps its place in `order` as Gone: the worker is asked to take it out
(Withdraw, while the batch may not have launched) and says in its completion whether it did
(Done.withdrawn: no rows of it in the outputs, and the completions count the kept places only)
or had launched the batch already (its rows are there, and dropped). Only WorkerHandle
(pool.py) calls these, from the core: one writer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tgw.shm.wire import Withdraw

from .pending import Pending


class Gone:
    """A withdrawn request's place in its batch: never answered; its rows are in the outputs
    unless the worker took it out before launch."""
    __slots__ = ("request",)

    def __init__(self, request: Pending):
        self.request = request

    @property
    def rows(self) -> int:
        return self.request.rows


@dataclass
class Inflight:
    batch_id: int
    model: str
    key: str                     # "name:version"
    requests: list[Pending]      # not yet answered nor withdrawn: a part's requests leave as it arrives
    block: int
    rows: int                    # rows the worker computes (less those it took out)
    answered: int = 0            # places of `order` answered by parts so far (they come in order)
    # the requests not yet answered as the worker's batch has them, withdrawn ones as Gone
    order: list = field(default_factory=list)
    reported: bool = False       # the worker's completion said what it took out (Done.withdrawn)

    def __post_init__(self) -> None:
        if not self.order:
            self.order = list(self.requests)

    @property
    def suspect(self) -> bool:
        """A retry after a worker death: it may be what kills workers."""
        return bool(self.requests) and self.requests[0].alone


def drop_from(requests: list[Pending], leaving: list[Pending]) -> None:
    """Take `leaving` out of `requests`, in place (others hold the list)."""
    gone = set(map(id, leaving))
    requests[:] = [p for p in requests if id(p) not in gone]


def take_out(batch: Inflight, wanted) -> tuple[list[Pending], Withdraw | None]:
    """The batch's requests that `wanted(p)` picks, withdrawn: out of `requests`, Gone in
    `order`; and the Withdraw to send while the worker may not have launched the batch (no part
    came yet, so their places are still indices in the batch as sent), else None."""
    hits = [p for p in batch.requests if wanted(p)]
    if not hits:
        return [], None
    places = [batch.order.index(p) for p in hits]
    for k, p in zip(places, hits):
        batch.order[k] = Gone(p)
    drop_from(batch.requests, hits)
    if batch.answered or batch.reported:
        return hits, None
    return hits, Withdraw(batch_id=batch.batch_id, requests=sorted(places))


def left_out(batch: Inflight, indices: list[int]) -> list:
    """The places the worker took out before launch (indices in the batch as sent), in order:
    out of `order` (what is left is the batch the worker ran), their rows out of `rows`."""
    batch.reported = True
    out = [batch.order[k] for k in sorted({i for i in indices if 0 <= i < len(batch.order)})]
    taken = set(map(id, out))
    batch.order[:] = [e for e in batch.order if id(e) not in taken]
    batch.rows -= sum(e.rows for e in out)
    live = [e for e in out if type(e) is not Gone]   # a worker bug: the broker never asked
    if live:
        drop_from(batch.requests, live)
    return out
