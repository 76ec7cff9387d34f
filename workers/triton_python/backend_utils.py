"""The module a Triton Python model imports as `triton_python_backend_utils` (as `pb_utils`):
the names python_backend documents, tgw's own implementation of each (workers/triton_python/).

What tgw does not serve from inside a model says so when used: BLS (`InferenceRequest.exec`,
`async_exec`) answers a response with an UNSUPPORTED error; a second response for a request
(decoupled mode), request rescheduling and loading or unloading other models raise
TritonModelException. Custom metrics
(`MetricFamily`) keep their values in the worker (`value()` reads them back); they are not
exported on tgw's /metrics.
"""
from __future__ import annotations

from .errors import TritonError, TritonModelException  # noqa: F401
from .messages import (TRITONSERVER_REQUEST_FLAG_SEQUENCE_END, TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,  # noqa: F401
                       TRITONSERVER_REQUEST_RELEASE_ALL, TRITONSERVER_REQUEST_RELEASE_RESCHEDULE,
                       TRITONSERVER_RESPONSE_COMPLETE_FINAL, InferenceRequest, InferenceResponse, Logger,
                       ResponseSender)
from .model_config import (ModelConfig, get_input_config_by_name, get_output_config_by_name,  # noqa: F401
                           using_decoupled_model_transaction_policy)
from .tensors import (TRITON_STRING_TO_NUMPY, Tensor, deserialize_bytes_tensor, numpy_to_triton_type,  # noqa: F401
                      serialize_byte_tensor, triton_string_to_numpy, triton_to_numpy_type)

current_model_dir = ""   # the folder of the model.py being set up or run (set by adapter.py)


def get_model_dir() -> str:
    """The folder of the model's model.py (Triton: the version folder)."""
    return current_model_dir


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    """The request's input `name`, or None."""
    return next((t for t in inference_request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    """The response's output `name`, or None."""
    return next((t for t in inference_response.output_tensors() if t.name() == name), None)


def _not_served(what: str):
    def refuse(*args, **kwargs):
        raise TritonModelException(f"{what} is not supported by tgw's Triton Python-backend compatibility: load "
                                   "and unload models with `tgw-broker models load|unload` or the HTTP/gRPC "
                                   "repository API")
    refuse.__name__ = what
    return refuse


load_model = _not_served("load_model")
unload_model = _not_served("unload_model")
is_model_ready = _not_served("is_model_ready")


class MetricFamily:
    """A custom metric family; its metrics count in this worker only (not on /metrics)."""

    COUNTER, GAUGE, HISTOGRAM = 0, 1, 2

    def __init__(self, name: str, description: str, kind: int):
        if kind not in (0, 1, 2):
            raise TritonModelException(f"MetricFamily {name!r}: kind must be COUNTER, GAUGE or HISTOGRAM")
        self.name, self.description, self.kind = name, description, kind

    def Metric(self, labels: dict | None = None, buckets: list | None = None) -> "Metric":   # noqa: N802 - Triton's
        if self.kind == MetricFamily.HISTOGRAM and not buckets:
            raise TritonModelException(f"MetricFamily {self.name!r}: a histogram metric needs buckets")
        return Metric(self.kind, dict(labels or {}))


class Metric:
    def __init__(self, kind: int, labels: dict):
        self.kind, self.labels, self._value = kind, labels, 0.0

    def increment(self, value: float) -> None:
        if self.kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException("a counter cannot be decreased")
        self._value += value

    def set(self, value: float) -> None:
        if self.kind == MetricFamily.COUNTER:
            raise TritonModelException("a counter cannot be set")
        self._value = float(value)

    def observe(self, value: float) -> None:
        if self.kind != MetricFamily.HISTOGRAM:
            raise TritonModelException("observe() is for histogram metrics")
        self._value += value

    def value(self) -> float:
        return self._value
