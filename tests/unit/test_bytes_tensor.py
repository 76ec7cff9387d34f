"""The bytes tensor layout (shm/bytes_tensor.py): round trips, row cuts, and every hostile frame
refused with a message that says where and why, before anything is sliced."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings, strategies as st

from tgw.shm.bytes_tensor import PREFIX, BytesTensorError, element, pack, row_cuts, starts, unpack


def test_layout_is_kserve_binary_bytes():
    assert pack([b"ab", "é", b""]) == b"\x02\x00\x00\x00ab" + b"\x02\x00\x00\x00\xc3\xa9" + b"\x00\x00\x00\x00"
    assert pack([]) == b""


def test_element_takes_bytes_like_and_str_only():
    assert element(bytearray(b"x")) == b"x" and element(memoryview(b"yz")) == b"yz" and element("ü") == "ü".encode()
    with pytest.raises(TypeError, match="not int"):
        element(3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=30))
def test_round_trip(items):
    buf = pack(items)
    assert unpack(buf, len(items)) == items
    assert unpack(memoryview(buf), len(items)) == items          # a frame's buffer reads the same
    at = starts(buf, len(items))
    assert len(at) == len(items) + 1
    assert [bytes(buf[at[k]:at[k + 1] - PREFIX]) for k in range(len(items))] == items


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.data())
def test_row_cuts_cut_rows(rows, per_row, data):
    items = data.draw(st.lists(st.binary(max_size=10), min_size=rows * per_row, max_size=rows * per_row))
    buf = pack(items)
    cuts = row_cuts(buf, [rows, per_row])
    assert len(cuts) == rows + 1 and cuts[0] == 0 and cuts[-1] == len(buf)
    for r in range(rows):   # each row is itself a well-formed tensor of its elements
        assert unpack(buf[cuts[r]:cuts[r + 1]], per_row) == items[r * per_row:(r + 1) * per_row]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=20), min_size=1, max_size=10), st.data())
def test_any_truncation_is_refused(items, data):
    buf = pack(items)
    cut = data.draw(st.integers(0, len(buf) - 1))
    with pytest.raises(BytesTensorError):
        starts(buf[:cut], len(items))


LEN = struct.Struct("<I").pack


@pytest.mark.parametrize("buf, count, limit, words", [
    (b"\x01\x00", 1, None, "inside its 4-byte length"),                      # a truncated prefix
    (LEN(5) + b"abc", 1, None, "says it is 5 bytes long, but only 3"),      # a length past the end
    (LEN(0xFFFFFFFF) + b"x", 1, None, "4294967295 bytes long"),             # a huge length: no allocation
    (pack([b"a"]) + b"zz", 1, None, "2 bytes follow the last"),             # trailing bytes
    (pack([b"a", b"b"]), 1, None, "follow the last of the 1 elements"),     # too many elements
    (pack([b"a"]), 2, None, "element 1 of 2"),                              # too few elements
    (b"", 1, None, "element 0 of 1"),
    (pack([b"abcdef"]), 1, 5, "the limit is 5 bytes an element"),          # an element over the limit
    (b"x", 0, None, "1 bytes follow"),
])
def test_hostile_frames_are_refused(buf, count, limit, words):
    with pytest.raises(BytesTensorError) as info:
        starts(buf, count, limit)
    assert words in str(info.value), str(info.value)


def test_an_element_at_the_limit_passes_and_empty_tensors_are_fine():
    assert unpack(pack([b"abcde"]), 1, 5) == [b"abcde"]
    assert unpack(b"", 0) == [] and starts(b"", 0) == [PREFIX]
    assert row_cuts(b"", [0]) == [0]
