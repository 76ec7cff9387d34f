"""The native client's sequence arguments (client/request.py), checked before anything is sent:
what Client.infer and AsyncClient.infer put in `Infer.sequence`, and the clear refusals; and the
status printout's line for a sequence model (cli/main.py)."""
from __future__ import annotations

import numpy as np
import pytest

from tgw.broker.cli.main import sequences_line
from tgw.client.request import prepare
from tgw.shm.errors import TgwError
from tgw.shm.wire import SequenceRef

pytestmark = pytest.mark.unit


def sent(**seq):
    call = prepare(1, "acc", {"x": np.zeros((1, 1), np.float32)}, token=None, default_tenant=None,
                   address="ipc:///tmp/x", **seq)
    return call.msg.sequence


def test_the_arguments_become_the_requests_sequence():
    assert sent() is None
    assert sent(sequence_id=7, sequence_start=True) == SequenceRef(id=7, start=True, end=False)
    assert sent(sequence_id="user-1", sequence_end=True) == SequenceRef(id="user-1", start=False, end=True)
    assert sent(sequence_id=np.uint64(2 ** 64 - 1)).id == 2 ** 64 - 1


@pytest.mark.parametrize("seq, said", [
    ({"sequence_id": 0}, "non-zero uint64 or a non-empty string"), ({"sequence_id": ""}, "non-empty string"),
    ({"sequence_id": 2 ** 64}, "non-zero uint64"), ({"sequence_id": True}, "non-zero uint64"),
    ({"sequence_id": 1.5}, "non-zero uint64"), ({"sequence_start": True}, "need a sequence_id"),
    ({"sequence_id": 3, "sequence_end": 1}, "booleans"),
])
def test_a_bad_sequence_argument_is_refused_before_sending(seq, said):
    with pytest.raises(TgwError, match=said) as info:
        sent(**seq)
    assert info.value.code.value == "INVALID_ARGUMENT"


def test_the_status_printout_has_a_line_per_sequence_model():
    line = sequences_line("acc", {"live": 3, "slots": 128, "started": 40, "ended": {"end": 37}, "refused": 2,
                                  "steps": 1200, "misrouted": 0})
    assert line == "sequences acc: 3/128 slots live, 40 started, 1200 steps, 0 misrouted, 2 refused, ended {'end': 37}"
