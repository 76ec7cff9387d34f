"""`InferenceRequest` and `InferenceResponse` as a Triton Python model's execute() sees and makes
them, a request's response sender (one response per request: decoupled models are refused at
load), and what tgw does not serve from inside a model: BLS calls (`exec`, `async_exec`) answer
a response carrying an UNSUPPORTED TritonError, as Triton answers a failed BLS call."""
from __future__ import annotations

import json
import logging

from .errors import TritonError, TritonModelException
from .tensors import Tensor

log = logging.getLogger("tgw.worker")

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

BLS_REFUSED = ("BLS is not supported by tgw's Triton Python-backend compatibility: a model cannot call "
               "model {model!r} from execute(); chain the models in a pipeline instead (docs/PIPELINES.md)")
_bls_told: set[str] = set()


def parameters_json(parameters) -> str:
    """Request or response parameters as Triton hands them: a JSON object's text."""
    if parameters is None:
        return "{}"
    if isinstance(parameters, str):
        return parameters
    if not isinstance(parameters, dict):
        raise TritonModelException(f"parameters must be a dict, not {type(parameters).__name__}")
    for key, value in parameters.items():
        if not isinstance(key, str) or isinstance(value, float) or not isinstance(value, (bool, int, str)):
            raise TritonModelException(f"parameter {key!r}: keys are str and values bool, int or str "
                                       f"(got {type(value).__name__})")
    return json.dumps(parameters)


class InferenceRequest:
    """One request: made by tgw for execute(), or by a model for BLS (which tgw refuses)."""

    def __init__(self, request_id: str = "", correlation_id=0, inputs=None, requested_output_names=None,
                 model_name: str = "", model_version: int = -1, flags: int = 0, timeout: int = 0,
                 preferred_memory=None, trace=None, parameters=None):
        if inputs is None or requested_output_names is None or not model_name:
            raise TypeError("InferenceRequest: inputs, requested_output_names and model_name are required")
        if not isinstance(correlation_id, (int, str)) or isinstance(correlation_id, bool):
            raise TritonModelException("Correlation ID must be integer or string")
        self._id, self._correlation_id, self._inputs = str(request_id), correlation_id, list(inputs)
        self._outputs, self._model, self._version = list(requested_output_names), model_name, model_version
        self._flags, self._timeout, self._parameters = int(flags), int(timeout), parameters_json(parameters)
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        self._sender: ResponseSender | None = None

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._id

    def correlation_id(self):
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        self._flags = int(flags)

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        return self._parameters

    def requested_output_names(self) -> list[str]:
        return list(self._outputs)

    def model_name(self) -> str:
        return self._model

    def trace(self):
        return None

    def is_cancelled(self) -> bool:
        return False

    def set_release_flags(self, flags: int) -> None:
        if flags != TRITONSERVER_REQUEST_RELEASE_ALL:
            raise TritonModelException("request rescheduling (TRITONSERVER_REQUEST_RELEASE_RESCHEDULE) is not "
                                       "supported by tgw: it serves sequences through sequence models")
        self._release_flags = flags

    def get_response_sender(self) -> "ResponseSender":
        """The sender a model may answer this request with instead of returning it (one response,
        during execute(), as Triton allows a model that is not decoupled)."""
        if self._sender is None:
            self._sender = ResponseSender()
        return self._sender

    def exec(self, decoupled: bool = False):
        """BLS: not served; the answer is a response with an UNSUPPORTED error (check has_error())."""
        if self._model not in _bls_told:
            _bls_told.add(self._model)
            log.warning(BLS_REFUSED.format(model=self._model))
        return InferenceResponse(error=TritonError(BLS_REFUSED.format(model=self._model), TritonError.UNSUPPORTED))

    async def async_exec(self, decoupled: bool = False):
        return self.exec(decoupled)


class ResponseSender:
    """A request's response sender, for a model that is not decoupled: it takes the request's one
    response (`send(response, flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL)`) during execute()."""

    def __init__(self):
        self.response: InferenceResponse | None = None
        self.closed = False

    def send(self, response=None, flags: int = 0) -> None:
        if self.closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        if response is not None:
            if not isinstance(response, InferenceResponse):
                raise TritonModelException(f"send() takes an InferenceResponse, not {type(response).__name__}")
            if self.response is not None:
                raise TritonModelException("a second response for one request: decoupled mode is not supported by "
                                           "tgw's Triton Python-backend compatibility (one response per request)")
            self.response = response
        if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self.closed = True

    def is_cancelled(self) -> bool:
        return False


class InferenceResponse:
    """`InferenceResponse(output_tensors=[...], error=None, parameters=None)`: one per request."""

    def __init__(self, output_tensors=None, error: TritonError | None = None, parameters=None):
        tensors = list(output_tensors or [])
        for t in tensors:
            if not isinstance(t, Tensor):
                raise TritonModelException(f"InferenceResponse: output_tensors must be pb_utils.Tensor objects, "
                                           f"found {type(t).__name__}")
        if error is not None and not isinstance(error, TritonError):
            raise TritonModelException(f"InferenceResponse: error must be a TritonError, not {type(error).__name__}")
        self._tensors, self._error, self._parameters = tensors, error, parameters_json(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


class Logger:
    """`pb_utils.Logger.log_info(message)` and its kin: lines in the worker's log, as tgw logs."""

    INFO, WARNING, ERROR, VERBOSE = 0, 1, 2, 3

    class LogLevel:
        INFO, WARNING, ERROR, VERBOSE = 0, 1, 2, 3

    _LEVELS = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.DEBUG}

    @staticmethod
    def log(message: str, level: int = 0) -> None:
        log.log(Logger._LEVELS.get(int(level), logging.INFO), "%s", message)

    @staticmethod
    def log_info(message: str) -> None:
        log.info("%s", message)

    @staticmethod
    def log_warn(message: str) -> None:
        log.warning("%s", message)

    @staticmethod
    def log_error(message: str) -> None:
        log.error("%s", message)

    @staticmethod
    def log_verbose(message: str) -> None:
        log.debug("%s", message)
