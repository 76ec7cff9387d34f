"""Tally: what one fault scenario's requests got, printed as one row of a table.

    from tally import Tally, row

    t = Tally("worker SIGKILL x2")           # one Tally per scenario
    t.add(client.infer(...))                 # or t.add(exc): an outcome, from any thread
    r = t.call(client.infer, "mlp", inputs)  # runs it, records the result or the TgwError, returns it
    load = Load(address, 8, make_inputs, tally=t)   # conftest.Load counts into t as it goes
    t.extend(results)                        # or count a list of outcomes at once
    t.add("unanswered")                      # a raw socket that gave up waiting: say so yourself
    row(t, "restarts 2")                     # prints ONE row (and the header before the first);
                                             # returns the Tally, for asserts

What an outcome counts as:
  * a dict (a reply's outputs)        -> "ok"
  * a TgwError from the broker        -> its code ("WORKER_DIED", ...)
  * the client's own timeout          -> "unanswered" (DEADLINE_EXCEEDED raised by the client when no
                                         reply came: its details carry `request_id`, no `model`)
  * a str                             -> that key ("ok", "unanswered", a code)

Read back: t.sent, t.ok, t.unanswered, t.errors (Counter code -> n, neither ok nor unanswered),
t.counts (Counter of everything). Every row also lands in ROWS; tests/conftest.py prints them all
as one table at the end of the session (`pytest tests/faults -s` shows each row as it comes too).
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Callable, Iterable

OK, UNANSWERED = "ok", "unanswered"
ROWS: list[str] = []
_HEAD = f"{'scenario':<50} {'sent':>6} {'OK':>6} {'unanswered':>10}  errors by code | notes"
_printed_header = False


def classify(outcome: Any) -> str:
    """The key an outcome counts under (see the module docstring)."""
    if isinstance(outcome, str):
        return outcome
    if isinstance(outcome, dict):
        return OK
    code = getattr(outcome, "code", None)
    if code is None:
        raise TypeError(f"not an outcome: {outcome!r}")
    code = getattr(code, "value", code)
    details = getattr(outcome, "details", None) or {}
    if code == "DEADLINE_EXCEEDED" and "request_id" in details and "model" not in details:
        return UNANSWERED  # tgw.client.Client raised it locally: no reply came at all
    return code


class Tally:
    """Outcomes of one scenario, counted by key; thread-safe."""

    def __init__(self, scenario: str):
        self.scenario = scenario
        self.counts: Counter = Counter()
        self._lock = threading.Lock()

    def add(self, outcome: Any) -> Any:
        key = classify(outcome)
        with self._lock:
            self.counts[key] += 1
        return outcome

    def extend(self, outcomes: Iterable[Any]) -> "Tally":
        for o in list(outcomes):
            self.add(o)
        return self

    def call(self, fn: Callable, *args, **kwargs) -> Any:
        """fn(*args, **kwargs), recorded; returns its result, or the TgwError it raised (not re-raised)."""
        from tgw.shm.errors import TgwError
        try:
            return self.add(fn(*args, **kwargs))
        except TgwError as err:
            return self.add(err)

    @property
    def sent(self) -> int:
        return sum(self.counts.values())

    @property
    def ok(self) -> int:
        return self.counts[OK]

    @property
    def unanswered(self) -> int:
        return self.counts[UNANSWERED]

    @property
    def errors(self) -> Counter:
        return Counter({k: n for k, n in self.counts.items() if k not in (OK, UNANSWERED)})

    def line(self, notes: str = "") -> str:
        errs = " ".join(f"{k}={n}" for k, n in sorted(self.errors.items())) or "-"
        return (f"{self.scenario[:50]:<50} {self.sent:>6} {self.ok:>6} {self.unanswered:>10}  {errs}"
                + (f" | {notes}" if notes else ""))


def row(t: Tally, notes: str = "") -> Tally:
    """Print t's row now (the header first, once per process) and keep it for the closing table."""
    global _printed_header
    text = t.line(notes)
    ROWS.append(text)
    print("\n" + ("" if _printed_header else _HEAD + "\n") + text, flush=True)
    _printed_header = True
    return t


def table() -> list[str]:
    """The header and every row printed so far, in order."""
    return [_HEAD, "-" * len(_HEAD), *ROWS] if ROWS else []
