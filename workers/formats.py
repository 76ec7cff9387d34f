"""Loading each servable format the way its authors intend, and what the loaded program allows.

torchscript: torch.jit.load, then torch.jit.freeze (weights inlined, constants folded).
export:      torch.export.load(...).module(), moved with torch.export.passes.move_to_device_pass.
aoti:        torch._inductor.aoti_load_package on the worker's device; its compiled-in input
             checks are turned on (AOTI_RUNTIME_CHECK_INPUTS), so a wrong shape is an error
             rather than a read past the end of a buffer.
onnx:        an onnxruntime InferenceSession on the worker's device, called through I/O binding
             (onnx_program.py); onnxruntime is imported only when an ONNX model loads.

`load_in_process` is also what the demo's answer check and the benchmark's in-process floor
call, so all three measure the very program the worker serves.
"""
from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass, field
from typing import IO, Callable, Optional, Union

import torch

from tgw.shm.model_format import aoti_metadata, onnx_info

# read once, by the package's first call: it must be set before any AOTInductor model runs
os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"

Dim = Union[int, tuple[int, Optional[int]], None]   # static size, (low, high or None: unbounded), unknown range


class FormatMismatch(ValueError):
    """The program cannot serve the model as the config declares it (dims, dtypes, device)."""


@dataclass
class Program:
    """A loaded model, callable on a batch's inputs, with what tgw knows of its inputs."""
    call: Callable
    fmt: str
    nbytes: int = 0                      # parameter and buffer bytes (0: unknown, the file's size stands in)
    dims: Optional[list[list[Dim]]] = None      # per input, per dim (batch first); None: not readable
    dtypes: Optional[list[torch.dtype]] = None
    names: list[str] = field(default_factory=list)
    # the program's own check against a declaration: the problems in words (ONNX: by name)
    check: Optional[Callable[..., list[str]]] = None


def load_in_process(fmt: str, f: Union[str, IO[bytes]], device: torch.device = torch.device("cpu"),
                    origin: Optional[str] = None) -> Program:
    """Load a model file of format `fmt` (a path, or an open binary file) on `device`; `origin`:
    the path `f` was copied from, where an ONNX model's external weights lie beside it."""
    if fmt == "onnx":
        return _onnx(f, device, origin)
    return LOADERS[fmt](f, device)


def _torchscript(f, device: torch.device) -> Program:
    # by name: torch then reads the archive record by record (a file object it reads whole)
    module = torch.jit.load(getattr(f, "name", f), map_location=device)
    module.eval()
    nbytes = storage_bytes(module)  # before freezing, which turns them into constants
    try:  # freezing inlines weights and folds constants; some scripted modules refuse it
        module = torch.jit.freeze(module)
    except Exception:
        pass
    return Program(module, "torchscript", nbytes)


def _export(f, device: torch.device) -> Program:
    ep = torch.export.load(f)
    if device.type != "cpu":
        ep = torch.export.passes.move_to_device_pass(ep, device)
    module = ep.module()
    values = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    names = list(ep.graph_signature.user_inputs)
    tensors = [values.get(n) for n in names]
    dims = [[_dim(d, ep.range_constraints) for d in t.shape] if isinstance(t, torch.Tensor) else [] for t in tensors]
    dtypes = [t.dtype if isinstance(t, torch.Tensor) else None for t in tensors]
    nbytes = storage_bytes(module) + sum(t.untyped_storage().nbytes() for t in ep.constants.values()
                                         if isinstance(t, torch.Tensor))
    return Program(module, "export", nbytes, dims, dtypes, [str(n) for n in names])


def _dim(size, ranges) -> Dim:
    if isinstance(size, int):
        return size
    expr = size.node.expr
    if not expr.is_Symbol or expr not in ranges:
        return None                      # a derived size (say 2*s0): dynamic, its own range not stated
    vr = ranges[expr]
    upper = None if not vr.upper.is_finite else int(vr.upper)
    return int(vr.lower), upper


def _aoti(f, device: torch.device) -> Program:
    meta = aoti_metadata(f)
    built_for = meta.get("AOTI_DEVICE_KEY", "cpu")
    if built_for != device.type:
        raise FormatMismatch(f"the AOTInductor package was compiled for {built_for}; this worker runs on {device} "
                             f"(compile it with the example inputs on {device.type})")
    missing = missing_cpu_features(meta.get("AOTI_CPU_ISA", ""))
    if device.type == "cpu" and missing:
        raise FormatMismatch(f"the AOTInductor package was compiled for CPUs with {meta['AOTI_CPU_ISA']}; this CPU "
                             f"lacks {', '.join(missing)}: compile it on (or for) this machine")
    if hasattr(f, "seek"):
        f.seek(0)
    model = torch._inductor.aoti_load_package(f, device_index=device.index if device.type == "cuda" else -1)
    return Program(model, "aoti")


# inductor's x86 vector ISA names (torch/_inductor/cpu_vec_isa.py) -> the /proc/cpuinfo flag each needs;
# others (INVALID_VEC_ISA: no vector code; neon, asimd, vsx, zvector) are not checked
ISA_FLAGS = {"avx2": "avx2", "avx512": "avx512f", "avx512_vnni": "avx512_vnni", "amx_tile": "amx_tile"}


def missing_cpu_features(isa: str, flags: Optional[set[str]] = None) -> list[str]:
    """The /proc/cpuinfo flags an AOTInductor CPU ISA string (say "AVX512 AVX512_VNNI") needs
    that this CPU (or `flags`) lacks; a package built for more would die of SIGILL in its first
    batch."""
    if flags is None:
        try:
            with open("/proc/cpuinfo") as f:
                flags = set(next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), []))
        except OSError:
            flags = set()
    wanted = [ISA_FLAGS[tok] for tok in isa.lower().split() if tok in ISA_FLAGS]
    return [w for w in wanted if flags and w not in flags]


def _onnx(f, device: torch.device, origin: Optional[str] = None) -> Program:
    from . import onnx_program   # onnxruntime only where ONNX models are served
    program = onnx_program.load(f, device, origin)
    if hasattr(f, "seek"):
        f.seek(0)
    return Program(program, "onnx", onnx_info(f).initializer_bytes, check=program.declare)


LOADERS = {"torchscript": _torchscript, "export": _export, "aoti": _aoti, "onnx": _onnx}


def storage_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the parameters and buffers (shared ones count once)."""
    sizes = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        storage = t.untyped_storage()
        sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


AOTI_INPUT_CHECK = re.compile(r"input_handles\[(\d+)\]: (.*?) at (\d+)")
# a batch below the package's range: torch specialises sizes 0 and 1, so a Dim(min=1) may compile to >= 2
AOTI_BATCH_TOO_SMALL = re.compile(r"too small at 0, expected it to be >= (\d+)")


def aoti_input_problem(exc: BaseException) -> Optional[tuple[int, int, str]]:
    """(input index, tensor dim, what it said) when `exc` is an AOTInductor input check's refusal."""
    m = AOTI_INPUT_CHECK.search(str(exc))
    return (int(m.group(1)), int(m.group(3)), str(exc).strip().splitlines()[0]) if m else None


def aoti_smallest_batch(exc: BaseException) -> Optional[int]:
    """The smallest batch an AOTInductor package takes, when `exc` is its refusal of a smaller one."""
    m = AOTI_BATCH_TOO_SMALL.search(str(exc))
    return int(m.group(1)) if m else None
