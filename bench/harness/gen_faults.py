"""The generation benchmark's fault and load rows (`tgw-bench generate`), each against a broker
of its own, bounded and self-stopping, on Unix sockets only:

* `cancel_row`: streams cancelled mid-generation (at their first output) by four means - a
  native cancel (closing the stream), the client closing its connection, a deadline, the
  caller's process SIGKILLed - beside bystander streams that run to their end; the slots the
  workers freed by their own count (status `generation.freed_by_cancel`) and the bystanders'
  outputs checked.
* `flood_row`: many sequences sent faster than one worker's slots serve them: each answered or
  refused OVERLOADED past the queue bound; the live sequences never above the slot pool (status
  sampled); broker and worker RSS over the run's second half.
* `kill_row`: a worker SIGKILLed every few seconds under greedy streams: every stream complete
  and equal to the model's own greedy run.

`python -m tgw.bench.harness.gen_faults ADDRESS MODEL N` is the caller the process-kill means
kills: N streams, "ready" printed once each has an output, then it waits to be killed.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

MEANS = ("cancel", "client_close", "deadline", "process_kill")
LONG = 128   # prompt + outputs of a stream to cancel (the bench's max_len is 160; quick's 128)


def generation(client, model: str) -> dict[str, Any]:
    return client.status()["models"][model]["generation"]


def _wait(pred: Callable[[], Any], limit_s: float, what: str) -> Any:
    end = time.monotonic() + limit_s
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {limit_s:g} s")
        time.sleep(0.02)


# ---- cancellation ---------------------------------------------------------------------------------

def _cancelled_stream(address: str, client, model: str, prompt: list[int], means: str, deadline_s: float,
                      got: list) -> None:
    """One stream, ended by `means` as soon as it has its first output (a deadline ends it by
    itself, mid-generation or, on a slow run, before its first output). `got` collects (means,
    outputs the stream had when it was ended)."""
    from tgw.client import Client
    own = Client(address) if means == "client_close" else None
    n = 0
    try:   # as long as the state holds: the cancel lands mid-generation, not after a short run ended by itself
        it = (own or client).generate(model, np.asarray(prompt, np.int64), max_outputs=LONG - len(prompt),
                                      timeout=deadline_s if means == "deadline" else 600)
        for _ in it:
            n += 1
            if means != "deadline":
                break
        if means == "cancel":
            it.close()
        elif means == "client_close":
            own.close()
    except Exception:  # noqa: BLE001 - DEADLINE_EXCEEDED: the point of that means
        pass
    finally:
        got.append((means, n))
        if own is not None:
            own.close()


def _wave(address: str, client, model: str, prompts: list[list[int]], means: str, deadline_s: float,
          side: list, got: list) -> None:
    """One wave: len(prompts) streams ended by `means` once each has its first output (the
    process kill: once all have theirs), beside the bystanders `side` (gen_drive Streams) that
    run to their end."""
    from tgw.bench.harness.gen_drive import _fill, generate_call
    side_t = [threading.Thread(target=_fill, args=(generate_call(client, model, 64, timeout=120), s.prompt, s),
                               daemon=True) for s in side]
    for t in side_t:
        t.start()
    ts = []
    if means == "process_kill":
        child = subprocess.Popen([sys.executable, "-m", "tgw.bench.harness.gen_faults", address, model,
                                  str(len(prompts))], stdout=subprocess.PIPE, text=True)
        try:
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the caller process to kill exited with {child.wait()}")
        finally:
            child.send_signal(signal.SIGKILL)   # by PID: the process started here
            child.wait()
        got += [(means, 1)] * len(prompts)
    else:
        ts = [threading.Thread(target=_cancelled_stream, daemon=True,
                               args=(address, client, model, p, means, deadline_s, got)) for p in prompts]
    for t in ts:
        t.start()
    for t in ts + side_t:
        t.join(300)


def cancel_row(address: str, model: str, plist: list[list[int]], check, total: int, wave: int, deadline_s: float,
               log: Callable[[str], None], limit_s: float = 60.0) -> dict[str, Any]:
    """`total` streams cancelled, a quarter by each means, one means after the other, `wave` at a
    time beside 4 bystanders; after each means, once every sequence ended, the slots the workers
    freed by their own count and the reasons the broker counted; the bystanders checked."""
    from tgw.client import Client
    from tgw.bench.harness.gen_drive import Stream
    client = Client(address)
    rows: dict[str, Any] = {}
    bystanders: list[Stream] = []
    t0, k = time.monotonic(), 0
    try:
        for means in MEANS:
            base, got, n_means = generation(client, model), [], 0
            while n_means < total // 4:
                n = min(wave, total // 4 - n_means)
                side = [Stream(time.perf_counter(), plist[(k + 7 * i) % len(plist)]) for i in range(4)]
                _wave(address, client, model, [plist[(k + i) % len(plist)] for i in range(n)], means, deadline_s,
                      side, got)
                bystanders += side
                n_means += n
                k += n
            # every sequence ended: the slots freed by a cancel came in the same Steps messages
            try:
                g, stuck = _wait(lambda: (lambda g: g if g["active"] == 0 else None)(generation(client, model)),
                                 limit_s, f"every sequence ended after the {means} streams"), None
            except TimeoutError as exc:
                g = generation(client, model)
                stuck = f"{exc}: {g['active']} still active"
            freed = g["freed_by_cancel"] - base["freed_by_cancel"]
            ended = {r: g["ended"].get(r, 0) - base["ended"].get(r, 0) for r in g["ended"]}
            rows[means] = {"streams": n_means, "freed_by_cancel": freed, "freed_pct": 100.0 * freed / n_means,
                           "ended": {r: v for r, v in ended.items() if v},
                           "before_first_output": sum(1 for _, n in got if n == 0),
                           **({"error": stuck} if stuck else {})}
            log(f"cancel by {means}: {rows[means]}")
    finally:
        client.close()
    wrong = [m for m in (check(s.prompt, s.outputs) for s in bystanders if not s.error) if m]
    freed = sum(r["freed_by_cancel"] for r in rows.values())
    return {"streams": total, "wave": wave, "deadline_s": deadline_s, "by_means": rows, "freed_by_cancel": freed,
            "freed_pct": 100.0 * freed / total, "wall_s": time.monotonic() - t0,
            "bystanders": len(bystanders), "bystanders_failed": sum(1 for s in bystanders if s.error),
            "bystanders_wrong": len(wrong), "first_wrong": wrong[0] if wrong else None}


def caller_main() -> None:
    """The caller the process-kill means kills (see the module docstring)."""
    from tgw.client import Client
    address, model, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    client = Client(address)
    streams = [client.generate(model, (np.arange(8, dtype=np.int64) + i) % 32, max_outputs=LONG - 8, timeout=600)
               for i in range(n)]
    barrier = threading.Barrier(n + 1)

    def first(it) -> None:
        next(it)
        barrier.wait()
        threading.Event().wait()   # hold the stream open until the process is killed

    for it in streams:
        threading.Thread(target=first, args=(it,), daemon=True).start()
    barrier.wait()
    print("ready", flush=True)
    threading.Event().wait()


# ---- many sequences against a pool --------------------------------------------------------------

def flood_row(address: str, model: str, pids: Callable[[], dict[str, int]], plist: list[list[int]], total: int,
              rate: float, max_outputs: int, log: Callable[[str], None], in_flight: int = 1000) -> dict[str, Any]:
    """`total` sequences sent at `rate` a second (open loop: a refusal does not hasten the next),
    at most `in_flight` unanswered (the client's own cap), through one AsyncClient."""
    import psutil
    from tgw.client import AsyncClient, Client
    from tgw.shm.errors import TgwError
    outcomes: dict[str, int] = {}
    peak, rss, stop = {"active": 0, "slots": 0}, [], threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        with Client(address) as c:
            while not stop.is_set():
                g = generation(c, model)
                peak["active"], peak["slots"] = max(peak["active"], g["active"]), max(peak["slots"], g["slots"])
                row = {"t": time.monotonic() - t0}
                for role, pid in pids().items():
                    try:
                        row[role] = psutil.Process(pid).memory_info().rss / 2**20
                    except psutil.Error:
                        pass
                rss.append(row)
                stop.wait(0.2)

    async def one(ac, sem, i: int) -> None:
        async with sem:
            try:
                n = 0
                async for _ in ac.generate(model, np.asarray(plist[i % len(plist)], np.int64), max_outputs=max_outputs,
                                           timeout=600):
                    n += 1
                key = "answered" if n == max_outputs else f"answered with {n} outputs"
            except TgwError as exc:
                key = exc.code.value if hasattr(exc.code, "value") else str(exc.code)
            except Exception as exc:  # noqa: BLE001
                key = type(exc).__name__
            outcomes[key] = outcomes.get(key, 0) + 1

    async def main() -> None:
        async with AsyncClient(address) as ac:
            sem, tasks, start = asyncio.Semaphore(in_flight), [], time.monotonic()
            for i in range(total):
                await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
                tasks.append(asyncio.create_task(one(ac, sem, i)))
            await asyncio.gather(*tasks)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        asyncio.run(main())
    finally:
        stop.set()
        sampler.join(10)
    wall = time.monotonic() - t0
    half = [r for r in rss if r["t"] >= wall / 2]
    growth = {role: (max(r.get(role, 0) for r in half) - half[0].get(role, 0)) if half else None
              for role in ("broker", "worker")}
    return {"sequences": total, "rate": rate, "in_flight": in_flight, "max_outputs": max_outputs, "outcomes": outcomes,
            "peak_active": peak["active"], "slots": peak["slots"], "wall_s": wall,
            "rss_mib_first": rss[0] if rss else None, "rss_mib_last": rss[-1] if rss else None,
            "rss_growth_second_half_mib": growth}


# ---- a worker killed under load -------------------------------------------------------------------

def kill_row(address: str, model: str, worker_pids: Callable[[], list[int]], plist: list[list[int]], check,
             streams: int, every_s: float, duration_s: float, log: Callable[[str], None],
             stream_timeout_s: float = 120.0) -> dict[str, Any]:
    """`streams` greedy streams back to back for `duration_s`; a worker SIGKILLed every `every_s`.
    Each stream has a deadline of `stream_timeout_s` (a stream lost in a resumption fails with
    DEADLINE_EXCEEDED instead of hanging the run)."""
    from tgw.client import Client
    from tgw.bench.harness.gen_drive import Stream, generate_call
    done: list[Stream] = []
    lock, stop, kills = threading.Lock(), threading.Event(), []
    client = Client(address)
    call = generate_call(client, model, 64, timeout=stream_timeout_s)

    def loop(i: int) -> None:
        k = 0
        while not stop.is_set():
            s = Stream(time.perf_counter(), plist[(i * 97 + k) % len(plist)])
            call(s.prompt, s)
            with lock:
                done.append(s)
            k += 1

    ts = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(streams)]
    for t in ts:
        t.start()
    end = time.monotonic() + duration_s
    try:
        while time.monotonic() < end:
            stop.wait(min(every_s, max(0.0, end - time.monotonic())))
            pids = worker_pids()
            if pids and time.monotonic() < end:
                pid = pids[len(kills) % len(pids)]
                os.kill(pid, signal.SIGKILL)   # a worker of the broker this row started
                kills.append(pid)
    finally:
        stop.set()
        for t in ts:
            t.join(600)
        client.close()
    wrong = [m for m in (check(s.prompt, s.outputs) for s in done if not s.error) if m]
    errors: dict[str, int] = {}
    for s in done:
        if s.error or len(s.outputs) != 64:
            key = (s.error or f"{len(s.outputs)} outputs")[:160]
            errors[key] = errors.get(key, 0) + 1
    return {"streams": streams, "kill_every_s": every_s, "duration_s": duration_s, "kills": len(kills),
            "sequences": len(done), "failed": sum(errors.values()), "errors": errors, "wrong": len(wrong),
            "first_wrong": wrong[0] if wrong else None,
            "resumed": sum(getattr(s.final, "resumed", 0) or 0 for s in done)}


if __name__ == "__main__":
    caller_main()
