"""The balancer recipes run for real: HAProxy and nginx, rendered for two real brokers.

Both brokers serve `mlp` over KServe v2 HTTP on free ports; the balancer (started in the
foreground, stopped by its PID) gets its recipe with only the addresses changed
(tests/recipes.py). Each test counts the requests every broker received (its own stats), so
"both brokers serve", "one routing key stays on one broker" and "a stopped broker gets nothing"
are read from the brokers, not inferred. The last test stops the second broker under load.
"""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
import tempfile
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from conftest import base_config, wait_until
from recipes import (HAPROXY_RECIPES, NGINX_RECIPES, NOT_INSTALLED, free_port, haproxy_proc, host_port,
                     nginx_proc, render_haproxy, render_nginx, tool)
from tgw.testing.child import BrokerProc
from tgw.client import Client
from tgw.shm.segment import list_segments

X = np.random.default_rng(26).standard_normal((2, 256), dtype=np.float32)


def check_answer(got: np.ndarray, want: np.ndarray) -> None:
    """Within float32 rounding: concurrent requests share batches, and a batch's size may change
    the last bits of a row's result (the BLAS kernels block by it)."""
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def brokers(model_files):
    """Two brokers, started at once (start-up is most of this module's time)."""
    dirs = [tempfile.mkdtemp(prefix="tgwr-", dir="/tmp") for _ in range(2)]
    cfg = base_config(model_files, "mlp")
    cfg["http"] = {"port": 0}
    started = [BrokerProc(cfg, d).start(wait=False) for d in dirs]
    try:
        for b in started:
            b.wait_ready()
            with Client(b.address) as c:
                b.http = c.status()["http"]
        with Client(started[0].address) as c:
            started[0].want = c.infer("mlp", {"x": X})["y"]
        yield started
    finally:
        codes = [b.stop() for b in started]
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    assert codes == [0, 0], "a broker exited non-zero on SIGTERM:\n" + "\n".join(b.output()[-3000:] for b in started)
    assert not any(list_segments(b.proc.pid) for b in started), "segments left in /dev/shm"


def served(b) -> int:
    with Client(b.address) as c:
        return c.stats()["models"]["mlp"]["requests"]


def infer(url: str, key: str | None = None, seq: str | None = None) -> np.ndarray:
    """One KServe v2 JSON inference of X through `url` (with a routing key, a sequence id header);
    the output, or an AssertionError."""
    body = json.dumps({"inputs": [{"name": "x", "shape": list(X.shape), "datatype": "FP32",
                                   "data": X.ravel().tolist()}]}).encode()
    headers = {"Content-Type": "application/json", **({"tgw-routing-key": key} if key else {}),
               **({"tgw-sequence-id": seq} if seq else {})}
    req = urllib.request.Request(f"{url}/v2/models/mlp/infer", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            reply = json.loads(r.read())
    except urllib.error.HTTPError as err:
        raise AssertionError(f"HTTP {err.code} through the balancer: {err.read()[:300]!r}") from None
    return np.array(reply["outputs"][0]["data"], dtype=np.float32).reshape(reply["outputs"][0]["shape"])


KEYS = ("alice", "bob", "carol", "dave", "erin", "frank")


def spread(brokers, url: str, n: int, key: str | None = None, seq: str | None = None) -> list[int]:
    """Send n requests through `url`, each answer checked; how many each broker received. With a
    sequence id, each request carries another routing key (the id must win over them)."""
    before = [served(b) for b in brokers]
    for i in range(n):
        check_answer(infer(url, KEYS[i % len(KEYS)] if seq else key, seq), brokers[0].want)
    return [served(b) - s for b, s in zip(brokers, before)]


def haproxy_stats(stats_url: str) -> dict[str, dict]:
    """Backend tgw's rows of HAProxy's stats page: server name (and BACKEND) -> its columns."""
    with urllib.request.urlopen(f"{stats_url}/stats;csv", timeout=10) as r:
        rows = csv.DictReader(io.StringIO(r.read().decode().lstrip("# ")))
        return {row["svname"]: row for row in rows if row["pxname"] == "tgw"}


def haproxy_states(stats_url: str) -> dict[str, str]:
    return {name: row["status"] for name, row in haproxy_stats(stats_url).items()}


@pytest.fixture
def haproxy(tmp_path):
    """start(recipe, brokers) -> (balancer URL, stats URL), once every server is UP; stopped by PID."""
    if not tool("haproxy"):
        pytest.skip(NOT_INSTALLED.format("haproxy"))
    procs = []

    def start(recipe: str, brokers) -> tuple[str, str]:
        port, stats = free_port(), free_port()
        config = tmp_path / os.path.basename(recipe)
        config.write_text(render_haproxy(recipe, f"127.0.0.1:{port}", f"127.0.0.1:{stats}",
                                         [host_port(b.http) for b in brokers], str(tmp_path / "haproxy.sock")))
        p = haproxy_proc(str(config), str(tmp_path / "haproxy.log")).start()
        procs.append(p)
        stats_url = f"http://127.0.0.1:{stats}"

        def all_up():
            states = haproxy_states(stats_url)
            return all(states.get(f"tgw{i}") == "UP" for i in range(1, len(brokers) + 1))
        p.wait_for(all_up, 30, "every server UP in haproxy's checks")
        return f"http://127.0.0.1:{port}", stats_url
    yield start
    for p in procs:
        p.stop(timeout=10)


def test_haproxy_least_conn_sends_to_both_brokers(brokers, haproxy):
    url, _ = haproxy(HAPROXY_RECIPES[0], brokers)
    counts = spread(brokers, url, 12)
    assert sum(counts) == 12 and min(counts) >= 3, f"requests per broker: {counts}"
    with urllib.request.urlopen(f"{brokers[0].http}/metrics", timeout=10) as r:
        assert "tgw_queue_depth{" in r.read().decode()   # the metric configs/kubernetes/hpa.yaml scales on


def test_haproxy_hash_keeps_each_routing_key_on_one_broker(brokers, haproxy):
    url, _ = haproxy(HAPROXY_RECIPES[1], brokers)
    homes = []
    for key in KEYS:
        counts = spread(brokers, url, 4, key)
        assert sorted(counts) == [0, 4], f"key {key!r} was split over brokers: {counts}"
        homes.append(counts.index(4))
    assert set(homes) == {0, 1}, f"every key hashed to one broker: {homes}"
    seq_homes = []   # a sequence id (docs/SEQUENCES.md) wins over routing keys that go both ways
    for seq in ("7", "8", "9", "10", "11", "12"):
        counts = spread(brokers, url, 6, seq=seq)
        assert sorted(counts) == [0, 6], f"sequence {seq} was split over brokers: {counts}"
        seq_homes.append(counts.index(6))
    assert set(seq_homes) == {0, 1}, f"every sequence id hashed to one broker: {seq_homes}"
    assert min(spread(brokers, url, 8)) >= 1, "requests without a key are balanced round robin"


@pytest.mark.parametrize("recipe", NGINX_RECIPES, ids=os.path.basename)
def test_nginx_serves_through_both_brokers(brokers, recipe):
    if not tool("nginx"):
        pytest.skip(NOT_INSTALLED.format("nginx"))
    prefix = tempfile.mkdtemp(prefix="tgw-nginx-")
    os.chmod(prefix, 0o755)   # nginx's workers run as nobody when the tests run as root
    port = free_port()
    p = nginx_proc(render_nginx(recipe, prefix, port, [host_port(b.http) for b in brokers]), prefix).start()
    url = f"http://127.0.0.1:{port}"
    try:
        p.wait_for(lambda: urllib.request.urlopen(f"{url}/v2/health/ready", timeout=5).status == 200, 30,
                   "nginx answering")
        if recipe.endswith("-hash.conf"):
            for key in ("alice", "bob", "carol"):
                assert sorted(spread(brokers, url, 4, key)) == [0, 4], f"key {key!r} was split over brokers"
            for seq in ("7", "8", "9"):   # the id wins over the routing keys each request carries
                assert sorted(spread(brokers, url, 6, seq=seq)) == [0, 6], f"sequence {seq} was split"
        counts = spread(brokers, url, 12)
        assert min(counts) >= 3, f"requests per broker without a key: {counts}"
    finally:
        p.stop(timeout=10)
        shutil.rmtree(prefix, ignore_errors=True)


def test_haproxy_marks_a_stopped_broker_down_and_no_request_fails(brokers, haproxy):
    """Last in the module: it stops the second broker (SIGTERM, a clean exit) under load."""
    url, stats_url = haproxy(HAPROXY_RECIPES[0], brokers)
    stop, failures, done = threading.Event(), [], [0]

    def caller():
        while not stop.is_set():
            try:
                check_answer(infer(url), brokers[0].want)
                done[0] += 1
            except AssertionError as err:
                failures.append(str(err))
    callers = [threading.Thread(target=caller) for _ in range(4)]
    for t in callers:
        t.start()
    try:
        wait_until(lambda: done[0] >= 20, 30, "load flowing through haproxy")
        assert brokers[1].stop() == 0, brokers[1].output()[-3000:]
        wait_until(lambda: haproxy_states(stats_url)["tgw2"].startswith("DOWN"), 30, "haproxy to mark tgw2 down")
        after = done[0]
        wait_until(lambda: done[0] >= after + 20, 30, "requests after tgw2 went down")
    finally:
        stop.set()
        for t in callers:
            t.join(60)
    assert not failures, f"{len(failures)} of {done[0] + len(failures)} requests failed: {failures[:3]}"
    backend = haproxy_stats(stats_url)["BACKEND"]
    print(f"{done[0]} requests, 0 failed; haproxy retried {backend['wretr']} and redispatched {backend['wredis']}")
    assert haproxy_states(stats_url)["tgw1"] == "UP" and served(brokers[0]) > 0
