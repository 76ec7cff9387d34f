"""One infer call, shared by Client, AsyncClient and streams: the request built from the
caller's arguments, and the outputs read from the reply.

What a call holds past its send (region slots) is released by `Call.end`, exactly once,
whichever way the call ends: a reply, an error, a timeout, a cancel or a lost connection.
"""
from __future__ import annotations

import math
import operator
from typing import Any

from tgw.shm.compression import for_address
from tgw.shm.errors import Code, fail
from tgw.shm.wire import PROTOCOL_VERSION, Infer, SequenceRef

from . import cuda as cuda_ipc   # no torch at import: only a call with CUDA tensors imports it
from .tensors import decode_outputs, encode as encode_tensors

RETURN_TYPES = ("numpy", "torch")


class Call:
    """A prepared infer request: its header, its tensor frames and how to read its reply."""

    __slots__ = ("msg", "frames", "declared", "sent", "timeout", "return_type", "region", "slots", "cuda",
                 "answered")

    def __init__(self, msg: Infer, frames: list, declared: int, sent: int, timeout: float | None,
                 return_type: str, region=None):
        """`declared`: the tensors' raw bytes; `sent`: the bytes of their frames."""
        self.msg, self.frames, self.declared, self.sent, self.timeout = msg, frames, declared, sent, timeout
        self.return_type, self.region = return_type, region
        self.slots = None       # the region's slots this call holds (regions.Region.place)
        self.cuda = None        # its CUDA tensors' plan (client/cuda.py), when it has any
        self.answered = False   # a reply came: the broker and its workers are done with the call

    def outputs(self, reply, frames: list) -> dict:
        """The reply's outputs as the caller asked for them (numpy arrays, or torch tensors; an
        output written into the caller's CUDA buffer is that buffer)."""
        self.answered = True
        metas, on_gpu = reply.outputs, None
        if self.cuda is not None:
            metas, frames, on_gpu = self.cuda.read(metas, frames)
        if self.region is not None:
            frames = self.region.read_outputs(metas, frames, self.slots)
        out = decode_outputs(metas, frames)
        if self.return_type == "torch":
            out = {k: as_torch(v) for k, v in out.items()}
        if on_gpu:
            out.update(on_gpu)
        return out

    def end(self, error: BaseException | None = None) -> None:
        """Release what the call holds (region slots, CUDA shares); safe to call more than once.
        `error`: what ended it, when it failed - an error the broker answered means nothing will
        touch the call's memory any more; one the client raised (a timeout, a lost connection)
        does not, so what the broker might still write into stays held."""
        if error is not None and getattr(error, "details", {}).get("source") != "client":
            self.answered = True
        if self.slots is not None:
            self.region.release(self.slots, self.answered)
            self.slots = None
        if self.cuda is not None:
            if self.answered:
                self.cuda.replied()
            self.cuda.end()


def as_torch(arr):
    """An output as a torch tensor: over the same memory; a bfloat16 array (ml_dtypes') as
    torch.bfloat16 over its bits; a bytes output stays a numpy object array (torch holds no bytes)."""
    import torch  # only for a caller who asked for torch tensors
    if arr.dtype.kind == "O":
        return arr
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view("<i2")).view(torch.bfloat16)
    return torch.from_numpy(arr)


def prepare(req_id: int, model: str, inputs: dict[str, Any], *, token: str | None, default_tenant: str | None,
            address: str, version: str | None = None, timeout: float | None = None, outputs: list[str] | None = None,
            priority: int = 0, compress: bool | str = False, tenant: str | None = None,
            routing_key: str | None = None, traceparent: str | None = None, return_type: str = "numpy",
            region=None, cuda_out: dict | None = None, wire_dtype: str | None = None, sequence_id: int | str | None = None,
            sequence_start: bool = False, sequence_end: bool = False) -> Call:
    """The Call for Client.infer's arguments (see there) to the broker at `address`; raises the
    TgwError a bad argument gets."""
    if timeout is not None and not timeout >= 0:
        raise fail(Code.INVALID_ARGUMENT, f"timeout must be >= 0 seconds, got {timeout}", timeout=timeout)
    if return_type not in RETURN_TYPES:
        raise fail(Code.INVALID_ARGUMENT, f"return_type must be one of {RETURN_TYPES}, got {return_type!r}")
    if compress not in (True, False, "auto"):
        raise fail(Code.INVALID_ARGUMENT, f"compress must be True, False or 'auto', got {compress!r}")
    sequence = sequence_ref(sequence_id, sequence_start, sequence_end)
    compress = for_address(compress, address)   # "auto" is off over ipc:// (docs/PROTOCOL.md section 4)
    host, on_gpu = cuda_ipc.split(inputs)   # CUDA tensors go by handle (encode would copy them to the host)
    metas, frames, declared, sent = encode_tensors(host, compress, wire_dtype) if host or not on_gpu else ([], [], 0, 0)
    msg = Infer(v=PROTOCOL_VERSION, id=req_id, model=model, version=version, inputs=metas, outputs=outputs,
                priority=priority, compress_outputs=compress,
                timeout_ms=None if timeout is None else math.ceil(timeout * 1000), token=token,
                tenant=tenant if tenant is not None else default_tenant, routing_key=routing_key,
                traceparent=traceparent, sequence=sequence)
    call = Call(msg, frames, declared, sent, timeout, return_type, region)
    if region is not None:
        region.place(call)   # large tensors into the region (their frames emptied), an output slice
    if on_gpu or cuda_out:
        call.cuda = cuda_ipc.place_cuda(call, on_gpu, cuda_out)
    return call


def sequence_ref(sequence_id, start: bool, end: bool) -> SequenceRef | None:
    """The request's sequence (docs/SEQUENCES.md): a correlation id - a uint64 (1 .. 2**64-1) or a
    non-empty string, as the model declares - and its start/end flags; None: no sequence."""
    if type(start) is not bool or type(end) is not bool:
        raise fail(Code.INVALID_ARGUMENT, f"sequence_start and sequence_end are booleans, got {start!r} and {end!r}")
    if sequence_id is None:
        if start or end:
            raise fail(Code.INVALID_ARGUMENT, "sequence_start/sequence_end need a sequence_id")
        return None
    if isinstance(sequence_id, str):
        if not sequence_id:
            raise fail(Code.INVALID_ARGUMENT, "sequence_id must be a non-zero uint64 or a non-empty string, got ''")
        return SequenceRef(id=sequence_id, start=start, end=end)
    try:
        cid = operator.index(sequence_id) if not isinstance(sequence_id, bool) else None
    except TypeError:
        cid = None
    if cid is None or not 0 < cid < 1 << 64:
        raise fail(Code.INVALID_ARGUMENT, f"sequence_id must be a non-zero uint64 or a non-empty string, got "
                   f"{sequence_id!r}")
    return SequenceRef(id=cid, start=start, end=end)
