"""A front's input region (broker/fronts/region.py): which inputs go into it, when a slot is
free again (any reply; a withdrawn request's only after a reply to a later request), and a
full region falling back to frames."""
from __future__ import annotations

import numpy as np
import pytest

from tgw.broker.fronts.region import FrontRegion
from tgw.shm.wire import TensorMeta

pytestmark = pytest.mark.unit
K = 16 * 1024


def request(rows: int, **kw):
    t = TensorMeta(name="x", dtype="float32", shape=[rows, 1024], **kw)   # rows * 4 KiB
    data = np.arange(rows * 1024, dtype=np.float32)
    return [t], [memoryview(data.tobytes())]


def test_large_raw_inputs_placed_freed_on_reply_and_withdrawn_ones_after_a_later_reply():
    region = FrontRegion(4 * K)
    region.handle = 7
    try:
        small, small_bufs = request(2)                        # 8 KiB: below the threshold
        assert region.place(1, small, small_bufs) == [] and len(small_bufs[0]) == 8192
        wrong, wrong_bufs = request(4)
        wrong[0].shape = [5, 1024]                            # its size is not its shape's: stays a frame
        lz4, lz4_bufs = request(4, compression="lz4")
        assert region.place(2, wrong, wrong_bufs) == [] and region.place(3, lz4, lz4_bufs) == []

        inputs, bufs = request(4)                             # 16 KiB: in the region
        want = bytes(bufs[0])
        assert region.place(4, inputs, bufs) == [0] and bufs == [b""]
        t = inputs[0]
        assert t.region == 7 and bytes(region.view[t.offset:t.offset + K]) == want
        region.unmark(inputs, [0])
        assert (inputs[0].region, inputs[0].offset) == (None, 0)

        big, big_bufs = request(40)                           # 160 KiB: no room in 64 KiB, a frame
        assert region.place(5, big, big_bufs) == [] and region.fallbacks == 1

        gone, gone_bufs = request(8)
        assert region.place(6, gone, gone_bufs) == [0]
        region.withdrawn([6], last_sent=6)
        region.answered(4)                                    # 4's reply: its slot free, 6's still held
        assert region.as_dict()["free_bytes"] == 2 * K
        region.answered(6)                                    # a late reply of 6 itself proves nothing
        assert region.as_dict()["free_bytes"] == 2 * K
        region.answered(7)                                    # a request sent after the WITHDRAW answered
        assert region.as_dict()["free_bytes"] == 4 * K and region.extents.free == [[0, 4 * K]]
        assert region.as_dict()["placed"] == 2
    finally:
        region.close()


def test_a_region_slice_kept_for_a_shadow_is_its_own_copy():
    from tgw.broker.front.regions import RegionFrame
    memory = bytearray(b"abcd" * 1024)
    frame = RegionFrame(memoryview(memory)[:4096])
    kept = frame.kept()
    memory[:4] = b"zzzz"   # the caller reuses its slot once answered
    assert bytes(kept.buffer[:4]) == b"abcd" and len(kept) == 4096 and bytes(frame.buffer[:4]) == b"zzzz"
