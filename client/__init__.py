"""tgw.client: the Python client library (numpy in, numpy out; torch tensors in and out, torch
imported only when the caller uses it): Client (threads), AsyncClient (asyncio), streams,
generation (a generator model's outputs as they come), shared-memory regions, CUDA tensors by
IPC handle.

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
    JobNotFoundError,
    ModelNotReadyError,
    RateLimitedError,
    OverloadedError,
    DeadlineExceededError,
    CircuitOpenError,
    OutOfGpuMemoryError,
    OutOfShmError,
    WorkerDiedError,
    ModelExecutionError,
    ModelExecutionErrorError,   # the old name of ModelExecutionError, the same class
    InternalError,
    UnavailableError,
)

from .aio import AsyncClient
from .client import Client
from .gen_stream import AsyncGeneration, Generation
from .generation import GenerationEnd
from .jobs import AsyncJob, Job, JobCancelled
from .results import InferResult
from .retry import RetryPolicy
from .settings import ConnectError
from .stream import StreamResult

__all__ = [
    "Client", "AsyncClient", "ConnectError", "InferResult", "RetryPolicy", "StreamResult", "Code", "TgwError",
    "Generation", "AsyncGeneration", "GenerationEnd", "Job", "AsyncJob", "JobCancelled",
    'InvalidArgumentError', 'InvalidInputShapeError', 'InvalidInputDtypeError', 'PayloadTooLargeError', 'UnauthenticatedError', 'ModelNotFoundError', 'VersionNotFoundError', 'JobNotFoundError', 'ModelNotReadyError', 'RateLimitedError', 'OverloadedError', 'DeadlineExceededError', 'CircuitOpenError', 'OutOfGpuMemoryError', 'OutOfShmError', 'WorkerDiedError', 'ModelExecutionError', 'ModelExecutionErrorError', 'InternalError', 'UnavailableError',
]
