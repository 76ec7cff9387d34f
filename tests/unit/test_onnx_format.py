"""ONNX files told from their bytes without onnxruntime or torch (shm/onnx_proto.py,
shm/model_format.py): detected by path and by open file, declared formats checked both ways,
anything else named clearly, external weights found beside the model or refused, and the
initializers' bytes (the footprint's floor) summed inline and external alike."""
from __future__ import annotations

import os
import zipfile

import numpy as np
import pytest

from tgw.broker.config.roots import ModelFileError, check_file
from tgw.shm.model_format import MODEL_FORMATS, ModelFormatError, detect, onnx_info
from tgw.shm.onnx_proto import NotOnnx, read_model

pytest.importorskip("onnx")
from tgw.testing.onnx_models import add_model  # noqa: E402


@pytest.fixture
def folder(tmp_path):
    add_model(str(tmp_path / "add.onnx"), 1)
    add_model(str(tmp_path / "ext.onnx"), 2, external=True, pad_floats=1000)
    with zipfile.ZipFile(tmp_path / "ts.pt", "w") as z:   # what a TorchScript archive's directory holds
        z.writestr("ts/code/__torch__.py", "")
        z.writestr("ts/data.pkl", b"")
    (tmp_path / "junk.onnx").write_bytes(b"hello, this is not a model\n" * 10)
    (tmp_path / "junk.bin").write_bytes(b"\x00\x01\x02")
    return tmp_path


def test_onnx_is_told_from_its_bytes(folder):
    assert "onnx" in MODEL_FORMATS
    assert detect(str(folder / "add.onnx")) == "onnx" == detect(str(folder / "add.onnx"), "onnx")
    with open(folder / "add.onnx", "rb") as f:   # the worker tells it from its private copy the same way
        assert detect(f) == "onnx" and f.tell() == 0
    os.rename(folder / "add.onnx", folder / "add.model")   # the content counts, not the name
    assert detect(str(folder / "add.model")) == "onnx"


def test_declared_formats_and_other_files_are_named(folder):
    with pytest.raises(ModelFormatError, match=r"ts\.pt is declared format: onnx but is a TorchScript archive"):
        detect(str(folder / "ts.pt"), "onnx")
    with pytest.raises(ModelFormatError, match=r"add\.onnx is declared format: export but is an ONNX model"):
        detect(str(folder / "add.onnx"), "export")
    with pytest.raises(ModelFormatError, match=r"junk\.onnx is not an ONNX model \(a ModelProto .*\): field"):
        detect(str(folder / "junk.onnx"))
    with pytest.raises(ModelFormatError, match=r"junk\.bin is not a zip archive, so none of torchscript, export, "
                                               r"aoti, nor an ONNX model"):
        detect(str(folder / "junk.bin"))
    # the broker's check of a config names the field at fault
    with pytest.raises(ModelFileError) as err:
        check_file(str(folder / "junk.onnx"), None, "onnx")
    assert err.value.field == "format" and "is not an ONNX model" in str(err.value)
    assert check_file(str(folder / "ext.onnx"), None) == "onnx"


def test_external_weights_must_lie_beside_the_model(folder):
    info = onnx_info(str(folder / "ext.onnx"))
    assert info.external_files == ["ext.onnx.data"] and info.ir_version == 8
    assert info.initializer_bytes == (4 + 1000) * 4 == onnx_info(str(folder / "add.onnx")).initializer_bytes + 4000
    os.unlink(folder / "ext.onnx.data")
    with pytest.raises(ModelFormatError, match=r"ext\.onnx: its weights lie in 'ext\.onnx\.data' \(external data\), "
                                               r"which is not beside it"):
        detect(str(folder / "ext.onnx"))
    # a location that climbs out of the model's folder is refused before onnxruntime would read it
    import onnx
    model = onnx.load(str(folder / "add.onnx"))
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="../w.data")
    (folder / "up.onnx").write_bytes(model.SerializeToString())   # onnx.save_model itself refuses ".."
    assert onnx_info(str(folder / "up.onnx")).external_files == ["../w.data"]
    with pytest.raises(ModelFormatError, match=r"'\.\./w\.data' \(external data\) lies outside the model's folder"):
        detect(str(folder / "up.onnx"))


@pytest.mark.parametrize("data, words", [
    (b"", "the file is empty"),
    (b"\x08", "the file ends inside a field"),
    (b"\x08\x08", "no graph"),                                   # ir_version only
    (b"\x3a\x05abc", "field 7 runs past the end of its message"),   # a graph longer than the file
    (b"\x0b", "wire type 3"),
])
def test_truncated_or_partial_model_protos_are_refused(tmp_path, data, words):
    path = tmp_path / "m.onnx"
    path.write_bytes(data)
    with open(path, "rb") as f, pytest.raises(NotOnnx, match=words):
        read_model(f)


def test_initializer_bytes_count_every_dtype(tmp_path):
    from onnx import TensorProto, helper, numpy_helper
    arrays = [np.zeros((3, 5), np.float16), np.zeros((7,), np.int64), np.zeros((2, 2, 2), np.uint8)]
    inits = [numpy_helper.from_array(a, f"w{i}") for i, a in enumerate(arrays)]
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], inits)
    import onnx
    onnx.save_model(helper.make_model(graph), str(tmp_path / "m.onnx"))
    assert onnx_info(str(tmp_path / "m.onnx")).initializer_bytes == sum(a.nbytes for a in arrays)
