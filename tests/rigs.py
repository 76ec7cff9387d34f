"""The broker assembled in the test process: the real assembly (broker/core/assembly.py) over
inproc:// sockets, for tests that call its parts. The loop is a fresh one that is not run
unless the test runs it (the parts' callbacks wait on it), or the running one."""
from __future__ import annotations

import asyncio
import itertools
import time
from contextlib import contextmanager

import zmq

from tgw.broker.core.assembly import assemble
from tgw.broker.sched.tenants import Tenants

_n = itertools.count()


@contextmanager
def assembled(cfg, clock=time.monotonic, roster=None, loop=None, **kw):
    """Yields the Broker; closes its sockets (and the loop it made) after."""
    ctx = zmq.Context()
    own_loop = loop is None
    loop = asyncio.new_event_loop() if own_loop else loop
    n = next(_n)
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    front.bind(f"inproc://rig-front{n}")
    back.bind(f"inproc://rig-back{n}")
    broker = assemble(cfg, loop, front, back, clock=clock, roster=roster, **kw)
    try:
        yield broker
    finally:
        broker.close()
        ctx.destroy(linger=0)
        if own_loop:
            loop.close()


def tenants_of(cfg, clock):
    """The tenants' quotas as the assembly builds them, for tests that build admission alone."""
    return Tenants(cfg.tenants, cfg.default_tenant, cfg.require_tenant, clock)
