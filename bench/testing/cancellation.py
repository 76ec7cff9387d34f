"""The cancellation run: requests whose callers give up while they wait behind a slow batch are
withdrawn - queued ones from their queue, staged ones from their batch before it launches - and
never computed; the other callers' answers are unaffected and exact.

One CPU worker serves the Recorder stage (cancel_stage.py), which logs every row it computes:
"never computed" is the worker's own count. A gate request holds the worker; then `requests`
requests are sent by callers that will give up, in four ways in turn - a native `cancel` (an
AsyncClient's tasks cancelled), a client closing (`bye`), an HTTP connection closed, a caller
process killed - with `keepers` requests of a caller that waits, interleaved. Once every
request is admitted (one batch of them staged behind the gate, the rest queued) the callers give
up; once the broker has let go of all of them the gate opens. `scenario` returns the counts:
computed, withdrawn by where (stats `cancelled`), keepers exact. tests/process/test_cancellation.py
runs it; at 1,000 requests it made bench/results/cancel-2026-12-02-063131.json (the retired
`tgw-bench cancel`, bench/results/RETIRED.md).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Callable

import numpy as np

from tgw.testing.cancel_stage import HANDLER
from tgw.testing.child import BrokerProc

WAYS = ("cancel", "close", "http", "gone")
GATE_TAG = -1
X_IN = [{"name": "x", "dtype": "float32", "shape": [4]}]
Y_OUT = [{"name": "y", "dtype": "float32", "shape": [4]}]
WAIT_S = 120.0    # the bound on every wait for the broker (generous: a loaded 2-core machine)

# a caller process that sends its requests and waits until it is killed
CHILD = textwrap.dedent("""
    import asyncio, sys, numpy as np
    from tgw.client.aio import AsyncClient
    async def main():
        ac = AsyncClient(sys.argv[1])
        await ac.connect()
        tasks = [asyncio.ensure_future(ac.infer(sys.argv[2], {"x": np.array([[float(t), 0, 0, 0]], np.float32)}))
                 for t in sys.argv[3:]]
        await asyncio.sleep(3600)
    asyncio.run(main())
""")


def recorder(name: str, log: str, gate: str = "", max_batch_size: int = 16, **extra) -> dict:
    """A config entry serving the Recorder stage as `name`."""
    return {"name": name, "versions": [{"version": "1", "handler": HANDLER}], "inputs": X_IN, "outputs": Y_OUT,
            "max_batch_size": max_batch_size, "max_queue": 8192, "device": "cpu",
            "options": {"log": log, **({"gate": gate} if gate else {})}, **extra}


def config(work: str, *extra: dict) -> dict:
    """One CPU worker (so everything waits behind the gate), the HTTP face on; `gate` (batches of
    one, holding its batch until work/gate exists) and `rec` (batches of 16, which wait up to 0.2 s
    to fill: the batch staged behind the gate is a full one), logging to work/."""
    log = os.path.join(work, "computed.log")
    return {"server": {"max_clients": 4096, "max_inflight_per_client": 8192},
            "workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 8, "output_arena_mb": 4},
            "http": {"host": "127.0.0.1", "port": 0},
            "models": [recorder("gate", log, os.path.join(work, "gate"), max_batch_size=1),
                       recorder("rec", log, max_delay_us=200_000), *extra]}


def computed(work: str) -> list[int]:
    """Every tag the Recorder computed, in order (one computed twice appears twice)."""
    try:
        with open(os.path.join(work, "computed.log")) as f:
            return [int(t) for line in f for t in line.split()]
    except FileNotFoundError:
        return []


def row(tag: int, gate: bool = False) -> np.ndarray:
    return np.array([[float(tag), 1.0 if gate else 0.0, 0.0, 0.0]], np.float32)


def wait_for(predicate: Callable[[], object], what: str, timeout: float = WAIT_S):
    """Poll `predicate` (a cheap look at the broker) until it is truthy; fail loudly past `timeout`."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.01)
    return value


def in_flight(stats: dict) -> int:
    return sum(p.get("inflight", 0) for p in stats["processes"] if p["role"] == "worker")


def plan(requests: int, keepers: int, ways=WAYS) -> list[tuple[int, str]]:
    """(tag, way) in sending order: the givers-up in turn by way, a keeper every so often."""
    order = [(t, ways[t % len(ways)]) for t in range(requests)]
    every = max(1, requests // max(keepers, 1))
    for k in range(keepers):
        order.insert(min(len(order), k * (every + 1)), (requests + k, "keep"))
    return order


async def http_send(address: str, model: str, tag: int):
    """An inference over a raw HTTP/1.1 connection, left open (its reply never read)."""
    host, port = address.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                   "data": row(tag)[0].tolist()}]}).encode()
    writer.write(f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    return writer


async def scenario(b: BrokerProc, work: str, requests: int, keepers: int, ways=WAYS, model: str = "rec") -> dict:
    """The scenario on a started broker `b` serving config(work); its counts."""
    from tgw.client import Client
    from tgw.client.aio import AsyncClient

    ask = Client(b.address)
    look = lambda: ask.stats()   # noqa: E731
    wait = lambda predicate, what: asyncio.to_thread(wait_for, predicate, what)   # noqa: E731
    http = ask.status()["http"]
    base = look()
    for name in ("computed.log", "gate"):   # a broker may serve several scenarios: each starts afresh (worker idle)
        if os.path.exists(os.path.join(work, name)):
            os.remove(os.path.join(work, name))
    admitted0 = base["models"].get(model, {}).get("requests", 0)
    gate_client, cancel_client, close_client, keep_client = (AsyncClient(b.address) for _ in range(4))
    child = None
    try:
        for c in (gate_client, cancel_client, close_client, keep_client):
            await c.connect()
        blocker = asyncio.ensure_future(gate_client.infer("gate", {"x": row(GATE_TAG, gate=True)}, timeout=WAIT_S))
        await wait(lambda: in_flight(look()) >= 1, "the gate batch on the worker")
        order = plan(requests, keepers, ways)
        tasks: dict[str, list] = {"cancel": [], "close": []}
        kept, writers, gone = {}, [], []
        for n, (tag, way) in enumerate(order):
            if way == "gone":
                gone.append(tag)
                continue
            if way == "http":
                writers.append(await http_send(http, model, tag))
                continue
            client = {"cancel": cancel_client, "close": close_client, "keep": keep_client}[way]
            task = asyncio.ensure_future(client.infer(model, {"x": row(tag)}, timeout=WAIT_S))
            if way == "keep":
                kept[tag] = task
            else:
                tasks[way].append(task)
            if n % 64 == 0:
                await asyncio.sleep(0)   # let the sends go out in order
        if gone:
            script = os.path.join(work, "caller.py")
            with open(script, "w") as f:
                f.write(CHILD)
            child = subprocess.Popen([sys.executable, script, b.address, model, *map(str, gone)])
        total = len(order)
        await wait(lambda: look()["models"][model]["requests"] - admitted0 == total, f"all {total} admitted")
        before = look()
        queued_before, staged_batches = before["models"][model]["queued"], in_flight(before) - 1
        # the callers give up, each its way
        for t in tasks["cancel"]:
            t.cancel()
        await close_client.close()
        for w in writers:
            w.close()
        if child is not None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        await asyncio.gather(*tasks["cancel"], *tasks["close"], return_exceptions=True)
        owed = keepers + 1
        await wait(lambda: look()["clients"]["owed"] <= owed, "every withdrawn request let go")
        open(os.path.join(work, "gate"), "w").close()
        answers = {tag: await task for tag, task in kept.items()}
        await blocker
        await wait(lambda: (s := look())["models"][model]["queued"] == 0 and in_flight(s) == 0, "the worker idle")
        after = look()
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        for c in (gate_client, cancel_client, close_client, keep_client):
            await c.close()
        ask.close()
    tags = computed(work)
    givers_up = {tag for tag, way in order if way != "keep"}
    computed_givers = sorted(givers_up.intersection(tags))
    exact = all(np.array_equal(out["y"], row(tag) + 1) for tag, out in answers.items())
    cancelled = delta(base, after, model)
    return {"requests": requests, "keepers": keepers, "ways": {w: sum(1 for _, x in order if x == w) for w in ways},
            "queued_at_give_up": queued_before, "staged_batches_at_give_up": staged_batches,
            "computed_of_withdrawn": len(computed_givers), "never_computed": requests - len(computed_givers),
            "never_computed_share": round((requests - len(computed_givers)) / max(requests, 1), 4),
            "keepers_computed": len(set(answers).intersection(tags)), "keepers_exact": exact,
            "rows_computed": len(tags), "cancelled": cancelled,
            "computed_twice": len(tags) - len(set(tags))}


def delta(before: dict, after: dict, model: str) -> dict[str, int]:
    """The model's withdrawn requests by where (stats `cancelled`) from `before` to `after`."""
    was = before.get("cancelled", {}).get(model, {})
    now = after.get("cancelled", {}).get(model, {})
    return {where: n - was.get(where, 0) for where, n in now.items() if n != was.get(where, 0)}
