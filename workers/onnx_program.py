"""An ONNX model served through onnxruntime: its session, its check against the declaration, its call.

The session runs on the worker's device: the CPU execution provider on a cpu worker (as many
intra-op threads as torch has, so a worker's share of the cores holds for ONNX models too), the
CUDA execution provider on a cuda worker (`onnxruntime-gpu`; the CPU wheel has none, and a cuda
worker refuses the model rather than run it slowly on the host). A batch's inputs are bound by
pointer to the tensors the worker already holds (I/O binding: the ring's views on the cpu, the
batch's device buffer on cuda), so onnxruntime reads them where they lie; its outputs are
allocated by onnxruntime and handed to torch by DLPack, without a copy.

The declaration is checked against the session at load (`OnnxProgram.declare`): every declared
input and output by name, its dtype and rank; a batched model's batch dim must be dynamic in
the file, a static one is refused with how to export it. Weights stored beside the file
(external data) are read from the model's own folder, though the file itself is loaded from
the worker's private copy of it.
"""
from __future__ import annotations

import os
from typing import IO, Optional, Union

import torch

from tgw.shm.model_format import onnx_info
from tgw.shm.wire import IOSpec, ModelSpec

# ONNX type strings (onnxruntime's NodeArg.type) -> tgw dtype; onnx TensorProto element types
ONNX_DTYPES = {"tensor(float)": "float32", "tensor(double)": "float64", "tensor(float16)": "float16",
               "tensor(bfloat16)": "bfloat16", "tensor(int8)": "int8", "tensor(int16)": "int16",
               "tensor(int32)": "int32", "tensor(int64)": "int64", "tensor(uint8)": "uint8",
               "tensor(uint16)": "uint16", "tensor(uint32)": "uint32", "tensor(uint64)": "uint64",
               "tensor(bool)": "bool"}
ELEMENT_TYPES = {torch.float32: 1, torch.uint8: 2, torch.int8: 3, torch.uint16: 4, torch.int16: 5, torch.int32: 6,
                 torch.int64: 7, torch.bool: 9, torch.float16: 10, torch.float64: 11, torch.uint32: 12,
                 torch.uint64: 13, torch.bfloat16: 16}
EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"
CUDA_EP, CPU_EP = "CUDAExecutionProvider", "CPUExecutionProvider"
EXPORT_HINT = ("export it with a dynamic batch dim: torch.onnx.export(model, args, f, dynamo=True, "
               "dynamic_shapes=({0: torch.export.Dim('batch')},))")


class OnnxUnavailable(RuntimeError):
    """onnxruntime (or its CUDA execution provider, on a cuda worker) is not installed."""


def _ort():
    try:
        import onnxruntime
    except ImportError:
        raise OnnxUnavailable("ONNX models need onnxruntime in the worker's environment: pip install "
                              "'tgw[onnx]' (or onnxruntime-gpu on a CUDA box)") from None
    return onnxruntime


class OnnxProgram:
    """A session, callable as a model: tensors in the session's (or the declaration's) input
    order in, the outputs (all, or the declared ones in declared order) out as torch tensors."""

    def __init__(self, session, device: torch.device):
        self.session, self.device = session, device
        self.inputs = session.get_inputs()
        self.outputs = session.get_outputs()
        self.in_names = [a.name for a in self.inputs]
        self.out_names = [a.name for a in self.outputs]
        self.where = ("cuda", device.index or 0) if device.type == "cuda" else ("cpu", 0)

    def declare(self, spec: ModelSpec) -> list[str]:
        """Each way the session differs from `spec`'s inputs and outputs, in words; when none,
        calls take the declared inputs and give the declared outputs, each in declared order."""
        batched = getattr(spec, "batched", True)
        problems = (_tensor_problems("input", spec.inputs, self.inputs, batched, spec.max_batch_size)
                    + _tensor_problems("output", spec.outputs, self.outputs, batched, spec.max_batch_size))
        if not problems:
            self.in_names = [t.name for t in spec.inputs]
            self.out_names = [t.name for t in spec.outputs]
        return problems

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        binding = self.session.io_binding()
        kind, index = self.where
        for name, x in zip(self.in_names, inputs):
            x = x.contiguous()
            binding.bind_input(name, kind, index, ELEMENT_TYPES[x.dtype], list(x.shape), x.data_ptr())
        for name in self.out_names:
            binding.bind_output(name, kind, index)
        if kind == "cuda":   # the batch's copies to the device were queued on torch's stream
            torch.cuda.current_stream(self.device).synchronize()
        self.session.run_with_iobinding(binding)
        # the inputs' memory must outlive the run: `inputs` holds it till here
        return [torch.from_dlpack(v._ortvalue) for v in binding.get_outputs()]


def load(f: Union[str, IO[bytes]], device: torch.device, origin: Optional[str] = None) -> OnnxProgram:
    """A session for the ONNX file `f` (a path or an open binary file) on `device`; `origin`:
    where the file lies, whose folder holds its external weights (default: `f`'s own)."""
    ort = _ort()
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    # no busy-waiting between batches: the broker and the other models share the worker's cores
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    path = origin or (f if isinstance(f, str) else None)
    if path is not None and onnx_info(f).external_files:
        options.add_session_config_entry(EXTERNAL_FOLDER, os.path.dirname(os.path.abspath(path)))
    providers = [CPU_EP]
    if device.type == "cuda":
        if CUDA_EP not in ort.get_available_providers():
            raise OnnxUnavailable(f"this worker runs on {device} but onnxruntime {ort.__version__} has no "
                                  f"{CUDA_EP} (it has {', '.join(ort.get_available_providers())}): install "
                                  "onnxruntime-gpu in place of onnxruntime")
        providers = [(CUDA_EP, {"device_id": device.index or 0}), CPU_EP]
    source = f if isinstance(f, str) else f.read()
    session = ort.InferenceSession(source, options, providers=providers)
    if device.type == "cuda" and session.get_providers()[0] != CUDA_EP:
        raise OnnxUnavailable(f"onnxruntime could not start {CUDA_EP} on {device} (its CUDA or cuDNN libraries "
                              "are missing or of another version: see the worker's log)")
    return OnnxProgram(session, device)


def _tensor_problems(kind: str, declared: list[IOSpec], args, batched: bool, max_batch: int) -> list[str]:
    by_name = {a.name: a for a in args}
    names = [t.name for t in declared]
    problems = []
    if kind == "input":
        extra = [a.name for a in args if a.name not in names]
        if extra:
            problems.append(f"the model's inputs {extra} are not declared (it takes {[a.name for a in args]}): "
                            "declare every input of the ONNX graph, by its name")
    for t in declared:
        a = by_name.get(t.name)
        if a is None:
            problems.append(f"{kind} {t.name!r} is declared but the model has no such {kind}; its {kind}s are "
                            f"{[x.name for x in args]} (ONNX tensors are matched by name)")
            continue
        problems += _one_tensor(kind, t, a, batched, max_batch)
    return problems


def _one_tensor(kind: str, t: IOSpec, a, batched: bool, max_batch: int) -> list[str]:
    in_model = ONNX_DTYPES.get(a.type)
    if in_model is None:
        return [f"{kind} {t.name!r} is {a.type} in the model, a type tgw does not serve"]
    problems = []
    if in_model != t.dtype:
        problems.append(f"{kind} {t.name!r} is {t.dtype} in the config but {in_model} in the model")
    model_dims = list(a.shape) if a.shape is not None else None
    want = list(t.reshape if t.reshape is not None else t.shape)
    if model_dims is None:    # rank unknown in the file: onnxruntime checks each call
        return problems
    if batched:
        if len(model_dims) != len(want) + 1:
            return problems + [f"{kind} {t.name!r} has {len(model_dims)} dims in the model {_shown(model_dims)}; the "
                               f"config declares {len(want)} after the batch dim"]
        batch, model_dims = model_dims[0], model_dims[1:]
        if kind == "input" and isinstance(batch, int) and not (batch == 1 and max_batch <= 1):
            problems.append(f"{kind} {t.name!r} has a static batch dim of {batch} in the model, but the broker "
                            f"batches 1..{max_batch} rows (max_batch_size): {EXPORT_HINT}, or set max_batch_size: 0 "
                            "if the model takes no batch dim")
    elif len(model_dims) != len(want):
        return problems + [f"{kind} {t.name!r} has {len(model_dims)} dims in the model {_shown(model_dims)}; the config "
                           f"declares {len(want)} (max_batch_size 0: no batch dim)"]
    for k, (w, d) in enumerate(zip(want, model_dims)):
        if w == -1 and isinstance(d, int):
            problems.append(f"{kind} {t.name!r} shape[{k}] is declared -1 (variable) but is static {d} in the model: "
                            f"declare {d}, or export with a dynamic dim there")
        elif w != -1 and isinstance(d, int) and d != w:
            problems.append(f"{kind} {t.name!r} shape[{k}] is declared {w} but is {d} in the model")
    return problems


def _shown(dims: list) -> str:
    return "[" + ", ".join(str(d) if isinstance(d, int) else (d or "?") for d in dims) + "]"
