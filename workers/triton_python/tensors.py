"""`Tensor` as a Triton Python model sees it (a name and a numpy array, or a torch tensor on a
GPU taken by DLPack), Triton's data types and their numpy types, and BYTES serialisation (each
element a 4-byte little-endian length then its bytes, in C order)."""
from __future__ import annotations

import struct

import numpy as np

from .errors import TritonModelException

# TRITONSERVER_DataType's numbering (Tensor.triton_dtype()) -> (config name, numpy type, tgw dtype)
TYPES: dict[int, tuple[str, type, str]] = {
    1: ("TYPE_BOOL", np.bool_, "bool"), 2: ("TYPE_UINT8", np.uint8, "uint8"),
    3: ("TYPE_UINT16", np.uint16, "uint16"), 4: ("TYPE_UINT32", np.uint32, "uint32"),
    5: ("TYPE_UINT64", np.uint64, "uint64"), 6: ("TYPE_INT8", np.int8, "int8"),
    7: ("TYPE_INT16", np.int16, "int16"), 8: ("TYPE_INT32", np.int32, "int32"),
    9: ("TYPE_INT64", np.int64, "int64"), 10: ("TYPE_FP16", np.float16, "float16"),
    11: ("TYPE_FP32", np.float32, "float32"), 12: ("TYPE_FP64", np.float64, "float64"),
    13: ("TYPE_STRING", np.object_, "bytes"), 14: ("TYPE_BF16", None, "bfloat16"),
}
BY_CONFIG_NAME = {name: code for code, (name, _, _) in TYPES.items()}
BY_TGW_DTYPE = {dtype: code for code, (_, _, dtype) in TYPES.items()}
BYTES_CODE = 13
TRITON_STRING_TO_NUMPY = {name: np_type for name, np_type, _ in TYPES.values() if np_type is not None}
TRITON_STRING_TO_NUMPY["TYPE_BOOL"] = bool   # as Triton's table has it


def triton_string_to_numpy(triton_type_string: str) -> type:
    """The numpy type of a config's `data_type` ("TYPE_FP32" -> np.float32)."""
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int):
    """The numpy type of a TRITONSERVER_DataType number; None for one numpy has no type for."""
    found = TYPES.get(data_type)
    return found[1] if found else None


_BY_NUMPY = {np.dtype(np_type): code for code, (_, np_type, _) in TYPES.items() if np_type is not None}


def numpy_to_triton_type(data_type):
    """The TRITONSERVER_DataType number of a numpy type (np.object_ and np.bytes_: 13, BYTES)."""
    kind = np.dtype(data_type)
    if kind.type == np.bytes_:
        return BYTES_CODE
    return _BY_NUMPY.get(kind)


def serialize_byte_tensor(input_tensor: np.ndarray):
    """A BYTES tensor as one bytes string of length-prefixed elements in C order (str and other
    objects as their UTF-8 text); () for an empty tensor, None for a tensor of another dtype."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    parts = []
    for item in input_tensor.ravel(order="C").tolist():
        raw = element_bytes(item)
        parts += [struct.pack("<I", len(raw)), raw]
    return b"".join(parts)


def deserialize_bytes_tensor(encoded_tensor) -> np.ndarray:
    """serialize_byte_tensor's layout back to a 1-D numpy object array of bytes."""
    view, out, at = memoryview(encoded_tensor).cast("B"), [], 0
    while at < len(view):
        if at + 4 > len(view):
            raise TritonModelException(f"deserialize_bytes_tensor: a length prefix is cut at byte {at}")
        n = struct.unpack_from("<I", view, at)[0]
        at += 4
        if at + n > len(view):
            raise TritonModelException(f"deserialize_bytes_tensor: an element of {n} bytes runs past the end")
        out.append(bytes(view[at:at + n]))
        at += n
    return object_array(out, [len(out)])


def element_bytes(item) -> bytes:
    """One BYTES element as sent: bytes as they are, anything else as its UTF-8 text."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    return (item if isinstance(item, str) else str(item)).encode("utf-8")


def object_array(flat: list, shape: list[int]) -> np.ndarray:
    """A numpy object array of `shape` holding `flat`'s items in C order (never nested arrays)."""
    out = np.empty(len(flat), dtype=np.object_)
    out[:] = flat
    return out.reshape(shape)


class Tensor:
    """`Tensor(name, numpy_array)`; a model reads inputs with `as_numpy()`; `from_dlpack` takes
    a torch (or any DLPack) tensor, which may live on a GPU."""

    def __init__(self, name: str, data):
        if not isinstance(name, str):
            raise TritonModelException(f"Tensor: name must be a str, not {type(name).__name__}")
        self._name, self._torch = name, None
        array = np.asarray(data)
        if array.dtype.kind == "U":   # str elements: sent as their UTF-8 bytes, as BYTES
            array = object_array([s.encode("utf-8") for s in array.ravel().tolist()], list(array.shape))
        if array.dtype != np.object_ and numpy_to_triton_type(array.dtype) is None:
            raise TritonModelException(f"Tensor {name!r}: numpy dtype {array.dtype} has no Triton data type")
        self._array = np.ascontiguousarray(array)

    @staticmethod
    def from_dlpack(name: str, capsule) -> "Tensor":
        """A tensor from a DLPack capsule or an object with __dlpack__ (a torch tensor, a CuPy array)."""
        import torch.utils.dlpack

        t = torch.utils.dlpack.from_dlpack(capsule)
        if t.device.type == "cpu":
            if t.dtype == torch.bfloat16:   # numpy has no bfloat16: kept as torch, as a GPU tensor is
                tensor = Tensor(name, np.zeros(0, np.float32))
                tensor._array, tensor._torch = None, t.contiguous()
                return tensor
            return Tensor(name, t.contiguous().numpy())
        tensor = Tensor(name, np.zeros(0, np.float32))
        tensor._array, tensor._torch = None, t.contiguous()
        return tensor

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        if self._array is None:
            raise TritonModelException("Tensor is stored in GPU and cannot be converted to NumPy."
                                       if not self.is_cpu() else
                                       f"Tensor {self._name!r} is bfloat16, which numpy has no type for: use "
                                       "to_dlpack()")
        return self._array

    def is_cpu(self) -> bool:
        return self._torch is None or self._torch.device.type == "cpu"

    def shape(self) -> list[int]:
        return list(self._array.shape if self._array is not None else self._torch.shape)

    def triton_dtype(self) -> int:
        if self._array is not None:
            return numpy_to_triton_type(self._array.dtype)
        import torch
        return {torch.bfloat16: 14}.get(self._torch.dtype) or numpy_to_triton_type(
            torch.empty(0, dtype=self._torch.dtype).numpy().dtype)

    def as_torch(self):
        """The data as a torch tensor (no copy on the CPU); BYTES tensors have none."""
        import torch
        if self._torch is not None:
            return self._torch
        if self._array.dtype == np.object_:
            raise TritonModelException(f"Tensor {self._name!r} is BYTES: it has no DLPack form")
        return torch.from_numpy(self._array)

    def to_dlpack(self):
        import torch.utils.dlpack
        return torch.utils.dlpack.to_dlpack(self.as_torch())

    def __dlpack__(self, stream=None):
        return self.as_torch().__dlpack__() if stream is None else self.as_torch().__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self.as_torch().__dlpack_device__()

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={self.shape()})"
