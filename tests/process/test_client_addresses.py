"""A broker address a client cannot connect to fails at once with ConnectError, naming the
address and the accepted forms, and leaves nothing open: no socket, no ZeroMQ context, no
thread (client/settings.py checks it, by shm/paths.address_problem, before any socket exists).

Each check runs in a fresh interpreter: a ZeroMQ context left with an open socket waits forever
in term(), so a regression shows as a probe that never answers (the bound below), and the
probe's own thread and context counts are what it leaves behind.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tgw.shm.paths import ADDRESS_FORMS, address_problem

BAD = ["foo", "/tmp/tgw.sock", "ipc://", "tcp://127.0.0.1", "tcp://:5555", "tcp://*:5555", "tcp://host:0",
       "tcp://host:http", "ipc://" + "x" * 200]
HANG_BOUND_S = 60   # a probe that has not answered by then hangs (today's Client: forever)

PROBE = r"""
import asyncio, gc, json, os, sys
import zmq
from tgw.client import AsyncClient, Client, ConnectError

def threads():
    return len(os.listdir("/proc/self/task"))

def open_contexts():
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, zmq.Context) and not o.closed)

async def connect_async(address):
    async with AsyncClient(address, connect_timeout=1):
        pass

def attempt(kind, address):
    try:
        if kind == "sync":
            Client(address, connect_timeout=1).close()
        else:
            asyncio.run(connect_async(address))
    except ConnectError as exc:
        return {"error": "ConnectError", "message": str(exc)}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None, "message": ""}

kind, before = sys.argv[1], threads()
out = [dict(attempt(kind, a or None), address=a) for a in sys.argv[2:]]
print(json.dumps({"results": out, "extra_threads": threads() - before, "open_contexts": open_contexts()}))
"""


def probe(kind: str, addresses: list[str], env: dict | None = None) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, kind, *addresses], capture_output=True, text=True,
                       timeout=HANG_BOUND_S, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_bad_addresses_raise_connect_error_and_leave_nothing_open(kind):
    out = probe(kind, BAD)
    for r in out["results"]:
        assert r["error"] == "ConnectError", r
        assert repr(r["address"]) in r["message"] and ADDRESS_FORMS in r["message"], r
    assert out["extra_threads"] == 0
    assert out["open_contexts"] == 0


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_bad_tgw_address_names_the_variable(kind):
    out = probe(kind, [""], env={"TGW_ADDRESS": "foo"})   # "": no address given, so $TGW_ADDRESS is read
    for r in out["results"]:
        assert r["error"] == "ConnectError", r
        assert "'foo'" in r["message"] and "$TGW_ADDRESS" in r["message"] and ADDRESS_FORMS in r["message"]
    assert out["extra_threads"] == 0 and out["open_contexts"] == 0


def test_a_path_without_scheme_suggests_ipc():
    assert "ipc:///tmp/tgw.sock?" in address_problem("/tmp/tgw.sock")


@pytest.mark.parametrize("address", ["ipc:///tmp/tgw-x/tgw.sock", "tcp://127.0.0.1:5555", "tcp://localhost:1",
                                     "tcp://[::1]:65535", "tcp://broker.example:7000"])
def test_good_addresses_pass(address):
    assert address_problem(address) is None


def test_a_link_whose_connect_fails_closes_its_sockets():
    """The second line of defence: a Link that ZeroMQ refuses leaves its context free to end, even
    while the error's traceback (which holds the Link) is alive, as in Client's cleanup."""
    code = ("import zmq\nfrom tgw.client.connection import Link\nctx = zmq.Context()\n"
            "try:\n    Link(ctx, 'foo', 1.0)\nexcept zmq.ZMQError:\n    ctx.term()\nprint('terminated')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_BOUND_S)
    assert r.returncode == 0 and r.stdout.strip() == "terminated", r.stderr


def test_tgw_bench_load_with_a_bad_address_is_one_line_on_stderr():
    r = subprocess.run([sys.executable, "-m", "tgw.bench.cli", "load", "--address", "foo", "--model", "mlp",
                        "--duration", "1"], capture_output=True, text=True, timeout=HANG_BOUND_S)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "'foo'" in lines[0] and ADDRESS_FORMS in lines[0]
    assert r.stdout == ""
