"""The demo's closed loop: n requests from CONCURRENCY threads sharing one Client, each thread
calling `call(client, rng)` -> (what it sent, the answer) until the n are used up."""
from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np

import demo_http
from tgw.client import Client, TgwError

CONCURRENCY = 8


def closed_loop(address: str, n: int, call: Callable) -> tuple[list, list, list, float]:
    """(records [(sent, answer)], latencies, error codes, seconds)."""
    records, latencies, errors = [], [], []
    lock, counter = threading.Lock(), iter(range(n))

    def worker(c: Client, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in counter:
            t0 = time.perf_counter()
            try:
                sent, answer = call(c, rng)
            except (TgwError, demo_http.HttpError) as err:
                with lock:
                    errors.append(getattr(err.code, "value", err.code))
                continue
            with lock:
                latencies.append(time.perf_counter() - t0)
                records.append((sent, answer))

    with Client(address) as c:
        threads = [threading.Thread(target=worker, args=(c, s)) for s in range(CONCURRENCY)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
    return records, latencies, errors, elapsed
