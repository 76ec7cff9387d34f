"""What each caller is owed: its requests admitted and not yet answered, capped at
server.max_inflight_per_client (OVERLOADED, reason client_inflight, past it).

Admission checks the cap and counts a request in; its exit (admission's leave) pays it back. A
pipeline's run counts once, at its entry (pipeline/executor.py), not per step.
"""
from __future__ import annotations

from tgw.shm.errors import Code, fail


class Owed:
    def __init__(self, max_owed: int):
        self.max_owed = max_owed               # server.max_inflight_per_client
        self.by_caller: dict[bytes, int] = {}  # caller -> requests admitted and not yet answered

    def check(self, ident: bytes) -> None:
        """OVERLOADED when this caller already has max_inflight_per_client requests unanswered."""
        if self.by_caller.get(ident, 0) >= self.max_owed:
            raise fail(Code.OVERLOADED, f"this caller already has {self.by_caller[ident]} requests in flight "
                       f"(server.max_inflight_per_client)", reason="client_inflight", limit=self.max_owed)

    def owe(self, ident: bytes) -> None:
        owed = self.by_caller
        owed[ident] = owed.get(ident, 0) + 1

    def paid(self, ident: bytes) -> None:
        owed = self.by_caller
        n = owed.get(ident, 0) - 1
        if n > 0:
            owed[ident] = n
        else:
            owed.pop(ident, None)

    def total(self) -> int:
        return sum(self.by_caller.values())
