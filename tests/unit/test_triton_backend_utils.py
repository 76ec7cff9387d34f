"""The Triton Python-backend compatibility (workers/triton_python/) on model files written at
test time and loaded as a worker loads a stage (StageRunner, its batches called directly): the
config document a model reads (protobuf's strings made numbers, defaults present), models of
max_batch_size 0 seeing no batch dim, auto_complete_config ignored with a warning, decoupled
models refused, responses that break the declaration failing their own request, the misuses
of execute() Triton refuses, BLS answered with an error, and the pb_utils helpers."""
from __future__ import annotations

import gc
import logging
import textwrap

import numpy as np
import pytest
import torch

import triton_py_models as models
from tgw.shm.wire import IOSpec, ModelSpec
from tgw.workers.stage_runner import StageLoadError, StageRunner
from tgw.workers.triton_python import backend_utils as pb_utils
from tgw.workers.triton_python.adapter import TritonModelLoadError, TritonStage

CPU = torch.device("cpu")


def runner(path: str, inputs: list[tuple], outputs: list[tuple], cls: str = "TritonPythonModel", **fields) -> StageRunner:
    # (name, dtype, shape[, reshape])
    io = lambda decl: [IOSpec(name=n, dtype=d, shape=list(s), reshape=r[0] if r else None)   # noqa: E731
                       for n, d, s, *r in decl]
    spec = ModelSpec(name=fields.pop("name", "m"), version="1", path="", format="stage", handler=f"{path}:{cls}",
                     device="cpu", inputs=io(inputs), outputs=io(outputs), **{"max_batch_size": 8, **fields})
    return StageRunner(spec, CPU)


def model_file(tmp_path, source: str) -> str:
    path = tmp_path / "m" / "1" / "model.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return str(path)


ADD_SUB_IO = ([("INPUT0", "float32", [4]), ("INPUT1", "float32", [4])],
              [("OUTPUT0", "float32", [4]), ("OUTPUT1", "float32", [4])])


def test_add_sub_with_its_config_batched_and_without_a_batch_dim(tmp_path):
    files = models.write(str(tmp_path))
    given = models.config_dict(models.ADD_SUB_CONFIG)
    assert given["input"][0]["dims"] == ["4"]   # protobuf's JSON: int64 as strings
    r = runner(files["add_sub"], *ADD_SUB_IO, options={"triton_model_config": {**given, "max_batch_size": 8}})
    config = r.module.config
    assert config["input"][0]["dims"] == [4] and config["output"][1]["label_filename"] == ""
    assert config["max_batch_size"] == 8 and config["input"][0]["format"] == "FORMAT_NONE"
    assert config["instance_group"] == [{"kind": "KIND_CPU"}] and config["parameters"] == {}
    x, y = torch.arange(12.).reshape(3, 4), torch.ones(3, 4)
    outs, failed = r.call({"INPUT0": x, "INPUT1": y}, 3, starts=[0, 1, 3], ids=[7, 8])
    assert failed == {} and outs[0].tolist() == (x + y).tolist() and outs[1].tolist() == (x - y).tolist()

    seen = []
    flat = runner(files["add_sub"], *ADD_SUB_IO, max_batch_size=0, batched=False)
    assert flat.module.config["max_batch_size"] == 0   # synthesised from the declaration
    execute = flat.module.model.execute
    flat.module.model.execute = lambda requests: seen.append([t.shape() for t in requests[0].inputs()]) or execute(requests)
    outs, _ = flat.call({"INPUT0": x[:1], "INPUT1": y[:1]}, 1)
    assert seen == [[[4], [4]]] and outs[0].tolist() == [(x[0] + 1).tolist()]   # no batch dim in, one row out

    # Triton's reshape: the model takes and returns [rows, 2, 2] of the declared [rows, 4]
    shaped = runner(files["add_sub"], *([(n, "float32", [4], [2, 2]) for n in names] for names in
                                        (("INPUT0", "INPUT1"), ("OUTPUT0", "OUTPUT1"))))
    seen.clear()
    execute = shaped.module.model.execute
    shaped.module.model.execute = lambda requests: seen.append([t.shape() for t in requests[0].inputs()]) or execute(requests)
    outs, failed = shaped.call({"INPUT0": x, "INPUT1": y}, 3, starts=[0, 2, 3])
    assert seen == [[[2, 2, 2], [2, 2, 2]]] and failed == {} and outs[1].tolist() == (x - y).tolist()


def test_auto_complete_is_ignored_with_a_warning_and_decoupled_models_are_refused(tmp_path, caplog):
    path = model_file(tmp_path, '''\
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            @staticmethod
            def auto_complete_config(config):
                config.add_input({"name": "EXTRA", "data_type": "TYPE_FP32", "dims": [2]})
                config.set_max_batch_size(16)
                return config

            def execute(self, requests):
                return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "X")]) for r in requests]

        class Decoupled(TritonPythonModel):
            @staticmethod
            def auto_complete_config(config):
                config.set_model_transaction_policy(dict(decoupled=True))
                return config

        class Wrong(TritonPythonModel):
            @staticmethod
            def auto_complete_config(config):
                return None
        ''')
    io = ([("X", "float32", [2])], [("X", "float32", [2])])
    with caplog.at_level(logging.WARNING, logger="tgw.worker"):
        r = runner(path, *io)
    assert "auto_complete_config changed input, max_batch_size; tgw ignores the change" in caplog.text
    assert r.module.config["max_batch_size"] == 8 and [t["name"] for t in r.module.config["input"]] == ["X"]
    with pytest.raises(TritonModelLoadError, match=r"decoupled mode .* is not supported"):
        runner(path, *io, cls="Decoupled")
    with pytest.raises(TritonModelLoadError, match=r"decoupled mode"):
        runner(path, *io, options={"triton_model_config": {"model_transaction_policy": {"decoupled": True}}})
    with pytest.raises(TritonModelLoadError, match="must return a valid pb.ModelConfig object"):
        runner(path, *io, cls="Wrong")


def test_responses_that_break_the_declaration_fail_their_own_request(tmp_path):
    path = model_file(tmp_path, '''\
        import asyncio
        import numpy as np
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            async def execute(self, requests):   # an async execute is awaited
                await asyncio.sleep(0)
                out = []
                for r in requests:
                    x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
                    kind = int(x.ravel()[0])
                    if kind == 1:
                        out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x.astype(np.float64))]))
                    elif kind == 2:
                        out.append(pb_utils.InferenceResponse([]))
                    elif kind == 3:
                        out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x[:, :1])]))
                    elif kind == 4:
                        out.append(None)
                    else:
                        out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
                return out

        class Sent:   # answers through the response senders (not decoupled: one response each)
            def execute(self, requests):
                for r in requests[1:]:
                    x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
                    r.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + 1)]),
                                                 flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        class Counted:
            def execute(self, requests):
                return [] if len(requests) > 1 else ()
        ''')
    r = runner(path, [("X", "float32", [2])], [("Y", "float32", [2])])
    x = torch.tensor([[0., 9.], [1., 1.], [2., 2.], [3., 3.], [4., 4.], [5., 5.]])
    outs, failed = r.call({"X": x}, 6, starts=[0, 1, 2, 3, 4, 5, 6])
    said = "Triton Python model 'm' (version 1): "
    assert failed == {1: said + "output 'Y' is float64, its config declares TYPE_FP32",
                      2: said + "the response has no output 'Y' (it has []): tgw answers every declared output",
                      3: said + "output 'Y' has shape [1, 1], its config declares ['rows', 2] (rows: 1, the request's batch)",
                      4: said + "execute() gave no InferenceResponse for this request (none in its list, none sent)"}
    assert {f.code for f in failed.values()} == {"MODEL_EXECUTION_ERROR"}   # the model's fault: 500
    assert outs[0][0].tolist() == [0., 9.] and outs[0][5].tolist() == [5., 5.]
    sent = runner(path, [("X", "float32", [2])], [("Y", "float32", [2])], cls="Sent")
    outs, failed = sent.call({"X": x[:3]}, 3, starts=[0, 1, 3])
    assert list(failed) == [0] and "none sent" in failed[0] and outs[0][1:].tolist() == (x[1:3] + 1).tolist()
    counted = runner(path, [("X", "float32", [2])], [("Y", "float32", [2])], cls="Counted")
    with pytest.raises(pb_utils.TritonModelException, match="Number of InferenceResponse objects do not match"):
        counted.call({"X": x[:2]}, 2, starts=[0, 1, 2])
    with pytest.raises(pb_utils.TritonModelException, match="Expected a list in the execute return"):
        counted.call({"X": x[:1]}, 1)


def test_bls_decoupled_senders_and_the_helpers(tmp_path):
    request = pb_utils.InferenceRequest(model_name="other", inputs=[], requested_output_names=["Y"])
    response = request.exec()
    assert response.has_error() and response.error().code() == pb_utils.TritonError.UNSUPPORTED
    assert "BLS is not supported" in response.error().message() and "'other'" in response.error().message()
    sender = request.get_response_sender()
    sender.send(pb_utils.InferenceResponse([]))
    with pytest.raises(pb_utils.TritonModelException, match="a second response for one request: decoupled mode"):
        sender.send(pb_utils.InferenceResponse([]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    assert pb_utils.TritonError("x").code() == pb_utils.TritonError.INTERNAL
    with pytest.raises(TypeError):
        pb_utils.TritonError("x", 99)

    words = np.array([[b"a", "\u00e9"], [b"", b"xyz"]], dtype=np.object_)
    packed = pb_utils.serialize_byte_tensor(words)
    assert packed[:5] == b"\x01\x00\x00\x00a" and pb_utils.deserialize_bytes_tensor(packed).tolist() == \
        [b"a", "\u00e9".encode(), b"", b"xyz"]
    assert pb_utils.numpy_to_triton_type(np.float32) == 11 and pb_utils.triton_to_numpy_type(13) is np.object_
    assert pb_utils.triton_string_to_numpy("TYPE_INT32") is np.int32
    t = pb_utils.Tensor.from_dlpack("T", torch.arange(3, dtype=torch.int64))
    assert t.as_numpy().tolist() == [0, 1, 2] and t.is_cpu() and t.triton_dtype() == 9
    assert torch.utils.dlpack.from_dlpack(pb_utils.Tensor("U", np.ones(2, np.float16)).to_dlpack()).tolist() == [1., 1.]
    with pytest.raises(pb_utils.TritonModelException, match="load_model is not supported"):
        pb_utils.load_model("x")

    # a class with both execute and __call__ is a plain stage; without either it is refused; a
    # file in the model's folder (REPO/M beside REPO/M/1/model.py) imports as in Triton
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tgw_test_beside_model.py").write_text("FACTOR = 3\n")
    path = model_file(tmp_path, '''\
        import tgw_test_beside_model

        class Both:
            def execute(self, requests):
                return []
            def __call__(self, batch):
                return {"Y": batch["X"]}

        class Neither:
            pass
        ''')
    both = runner(path, [("X", "float32", [1])], [("Y", "float32", [1])], cls="Both")
    assert not isinstance(both.module, TritonStage) and both.call({"X": torch.ones(1, 1)}, 1)[0][0].tolist() == [[1.]]
    with pytest.raises(StageLoadError, match=r"has no __call__\(batch\) \(nor execute\(requests\)"):
        runner(path, [("X", "float32", [1])], [("Y", "float32", [1])], cls="Neither")


def test_finalize_runs_when_the_stage_is_dropped(tmp_path):
    files = models.write(str(tmp_path))
    r = runner(files["picky"], [("X", "int64", [1])], [("Y", "int64", [1]), ("NREQ", "int64", [1])])
    marker = tmp_path / "picky" / "finalized-1"
    assert not marker.exists()
    del r
    gc.collect()
    assert marker.read_text() == "finalized"
