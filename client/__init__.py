"""tgw.client: the Python client library (numpy in, numpy out; torch tensors accepted lazily).

    from tgw.client import Client
    with Client() as c:
        y = c.infer("mlp", {"x": np.zeros((4, 256), np.float32)})["y"]
"""
from tgw.shm.errors import (
    Code,
    TgwError,
    InvalidArgumentError,
    InvalidInputShapeError,
    InvalidInputDtypeError,
    PayloadTooLargeError,
    UnauthenticatedError,
    ModelNotFoundError,
    VersionNotFoundError,
    ModelNotReadyError,
    RateLimitedError,
    OverloadedError,
    DeadlineExceededError,
    CircuitOpenError,
    OutOfGpuMemoryError,
    OutOfShmError,
    WorkerDiedError,
    ModelExecutionErrorError,
    InternalError,
    UnavailableError,
)

from .client import Client, ConnectError, InferResult

__all__ = [
    "Client", "ConnectError", "InferResult", "Code", "TgwError",
    'InvalidArgumentError', 'InvalidInputShapeError', 'InvalidInputDtypeError', 'PayloadTooLargeError', 'UnauthenticatedError', 'ModelNotFoundError', 'VersionNotFoundError', 'ModelNotReadyError', 'RateLimitedError', 'OverloadedError', 'DeadlineExceededError', 'CircuitOpenError', 'OutOfGpuMemoryError', 'OutOfShmError', 'WorkerDiedError', 'ModelExecutionErrorError', 'InternalError', 'UnavailableError',
]
