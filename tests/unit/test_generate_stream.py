"""One generation's record (broker/generate/stream.py), pure: what its caller has not read, from
the replies libzmq tells it is done with, and what a resumption carries."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tgw.broker.generate.stream import QUEUED, Stream
from tgw.shm.wire import GenSeq, IOSpec

pytestmark = pytest.mark.unit


class Tracker:
    def __init__(self):
        self.done = False


def stream() -> Stream:
    p = SimpleNamespace(generate=GenSeq(seq=7, max_outputs=10))
    return Stream(p, [IOSpec(name="token", dtype="int64", shape=[])])


def test_held_counts_from_the_newest_reply_libzmq_is_done_with():
    s = stream()
    first, third = Tracker(), Tracker()
    s.went_out(1, 8, first)
    s.went_out(2, 16, None)          # untracked: held until a later tracked reply is done
    s.went_out(1, 8, third)
    assert s.held() == (4, 32)
    first.done = True
    assert s.held() == (3, 24)
    third.done = True                # replies leave in order: the untracked ones went before it
    assert s.held() == (0, 0) and s.tracked_at == 4 and not s.unread


def test_a_resumption_carries_every_output_sent():
    s = stream()
    for k in (11, 12, 13):
        s.kept["token"] += np.int64(k).tobytes()
        s.went_out(1, 8, None)
    s.requeued()
    assert (s.phase, s.resumed, s.gen.delivered) == (QUEUED, 1, 3)
    assert np.frombuffer(s.gen.prefix[0], np.int64).tolist() == [11, 12, 13]
