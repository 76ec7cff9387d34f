"""tgw's errors as gRPC statuses: the abort that carries a TgwError, with the status, details and
trailing metadata the protocol layer names (protocol/errors.py), beside what the call set
before (the load report, face.py).
"""
from __future__ import annotations

import grpc

from tgw.shm.errors import TgwError

from tgw.broker.protocol.errors import details, grpc_status, trailers


def add_trailers(context: grpc.aio.ServicerContext, *pairs: tuple[str, str]) -> None:
    """`pairs` added to the call's trailing metadata (setting it replaces what was set before)."""
    context.set_trailing_metadata(tuple(context.trailing_metadata() or ()) + pairs)


async def abort(context: grpc.aio.ServicerContext, err: TgwError, trace: str | None = None):
    """End the call with the error's status (raises grpc.aio.AbortError, as context.abort does),
    its trailers added to those already set."""
    await context.abort(grpc.StatusCode[grpc_status(err)], details(err),
                        tuple(context.trailing_metadata() or ()) + trailers(err, trace))
