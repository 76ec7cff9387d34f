"""Small ONNX models the tests build at run time with the onnx package's helpers (no torch export:
milliseconds each), the shapes and types a test wants written straight into the graph.

`add_model`: y = x + k (version k of a model answers x + k, as tgw.testing.lifecycle's TorchScript
models do), a float32 [batch, width] graph whose batch dim is dynamic unless `batch` is an int;
`external=True` stores k's tensor in a file beside the model (ONNX external data). `two_inputs`:
a graph whose inputs are of two dtypes and whose outputs come in the other order, to test
binding by name.
"""
from __future__ import annotations

import os
from typing import Union

import numpy as np

Dim = Union[int, str, None]


def _save(model, path: str, external: bool = False) -> str:
    import onnx
    if external:
        onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=os.path.basename(path) + ".data", size_threshold=0)
    else:
        onnx.save_model(model, path)
    return path


def _model(graph):
    from onnx import helper
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tgw-tests")
    model.ir_version = 8   # read by every onnxruntime this project allows
    return model


def add_model(path: str, k: float, width: int = 4, batch: Dim = "batch", external: bool = False,
              pad_floats: int = 0) -> str:
    """y = x + k over float32 [batch, width]; `pad_floats` zeros ride along as a second weight."""
    from onnx import TensorProto, helper, numpy_helper
    kk = numpy_helper.from_array(np.full((width,), k, np.float32), "k")
    inits = [kk]
    nodes = [helper.make_node("Add", ["x", "k"], ["y"])]
    if pad_floats:
        inits.append(numpy_helper.from_array(np.zeros((pad_floats,), np.float32), "pad"))
    graph = helper.make_graph(nodes, "add", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, width])], inits)
    return _save(_model(graph), path, external)


def two_inputs(path: str) -> str:
    """ids int64 [batch, -1] and scale float32 [batch, 1] -> count int64 [batch] (ids' length)
    and scaled float32 [batch, -1] (ids as floats times scale), declared outputs first count."""
    from onnx import TensorProto, helper
    nodes = [helper.make_node("Cast", ["ids"], ["idf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["idf", "scale"], ["scaled"]),
             helper.make_node("Shape", ["ids"], ["shape"]),
             helper.make_node("Slice", ["shape", "one", "two"], ["len1"]),
             helper.make_node("Expand", ["len1", "rows"], ["count"]),
             helper.make_node("Shape", ["ids"], ["rows_shape"]),
             helper.make_node("Slice", ["rows_shape", "zero", "one"], ["rows"])]
    consts = [helper.make_tensor(n, TensorProto.INT64, [1], [v]) for n, v in (("zero", 0), ("one", 1), ("two", 2))]
    graph = helper.make_graph(
        nodes, "two",
        [helper.make_tensor_value_info("scale", TensorProto.FLOAT, ["batch", 1]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "tokens"])],
        [helper.make_tensor_value_info("scaled", TensorProto.FLOAT, ["batch", "tokens"]),
         helper.make_tensor_value_info("count", TensorProto.INT64, ["batch"])], consts)
    return _save(_model(graph), path)
