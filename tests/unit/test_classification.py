"""The classification extension (broker/protocol/classification.py) and label files
(broker/config/labels.py): Triton's strings, per row, k capped, its refusals."""
from __future__ import annotations

import numpy as np
import pytest

from tgw.broker.config.labels import LabelFileError, read_labels
from tgw.broker.protocol.classification import class_count, classified, top_k
from tgw.shm.bytes_tensor import unpack
from tgw.shm.errors import TgwError
from tgw.shm.wire import InferReply, TensorMeta


def reply(dtype: str, shape: list[int], values) -> tuple[InferReply, list]:
    meta = TensorMeta(name="y", dtype=dtype, shape=shape)
    other = TensorMeta(name="z", dtype="int64", shape=[1])
    return InferReply(v=1, id=1, model="m", version="1", outputs=[meta, other]), \
        [np.asarray(values, dtype=dtype).tobytes(), np.zeros(1, np.int64).tobytes()]


def test_top_k_is_written_as_tritons_std_to_string():
    assert top_k(np.array([0.1, 0.7, 0.2], np.float32), 2, None) == ["0.700000:1", "0.200000:2"]
    assert top_k(np.array([3, 9, 9], np.int32), 5, ["a", "b"]) == ["9:1:b", "9:2", "3:0:a"]   # ties: lower index
    assert top_k(np.array([1e-7, -2.5], np.float64), 1, None) == ["0.000000:0"]


def test_each_row_of_a_batch_its_own_top_k_and_other_outputs_untouched():
    r, frames = reply("float32", [2, 3], [[0.1, 0.7, 0.2], [0.9, 0.0, 0.5]])
    out, got = classified(r, frames, {"y": 2}, True, {"y": ["cat", "dog", "eel"]})
    assert out.outputs[0].dtype == "bytes" and out.outputs[0].shape == [2, 2] and out.outputs[1] == r.outputs[1]
    assert [s.decode() for s in unpack(got[0], 4)] == ["0.700000:1:dog", "0.200000:2:eel", "0.900000:0:cat",
                                                        "0.500000:2:eel"]
    assert got[1] is frames[1]
    flat, got = classified(r, frames, {"y": 9}, False, {})   # no batch dim: one top-k of all 6, k capped
    assert flat.outputs[0].shape == [6] and len(unpack(got[0], 6)) == 6


def test_what_triton_refuses():
    r, frames = reply("float16", [1, 2], [[1, 2]])
    with pytest.raises(TgwError, match="class result not available for output due to unsupported type 'FP16'"):
        classified(r, frames, {"y": 1}, True, {})
    with pytest.raises(TgwError, match="Output can't set both 'shared_memory_region' and 'classification'"):
        class_count({"classification": 2, "shared_memory_region": "r"}, "y", True)
    with pytest.raises(TgwError, match="Unable to set 'classification'"):
        class_count({"classification": "2"}, "y", False)
    assert class_count({}, "y", False) == 0 and class_count({"classification": 3}, "y", False) == 3


def test_label_files(tmp_path):
    (tmp_path / "l.txt").write_bytes(b"cat\r\ndog\n\nemu")
    assert read_labels(str(tmp_path / "l.txt")) == ["cat", "dog", "", "emu"]   # line k is class k, blanks too
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(LabelFileError, match="not UTF-8"):
        read_labels(str(tmp_path / "bad.txt"))
    with pytest.raises(LabelFileError, match="No such file"):
        read_labels(str(tmp_path / "none.txt"))
