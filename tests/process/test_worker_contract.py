"""The worker's start-up contract (tgw/shm/wire_start.py): one WorkerStart, the worker's only
argument; the broker sets nothing in its own environment for its workers; a bad argument is
refused naming the field; the hello reports the ring's page-locking in effect; one roster."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from conftest import base_config
from rigs import assembled
from tgw.broker.config.load import SupervisorDecl, WorkersDecl, parse_config
from tgw.broker.config.schema import TracingDecl
from tgw.broker.fleet.handshake import Handshake
from tgw.broker.fleet.supervisor import Supervisor
from tgw.broker.observe import logs, tracing
from tgw.shm.wire import PROTOCOL_VERSION, WorkerHello
from tgw.shm.wire_start import BadStart, WorkerStart, decode_start, encode_start
from tgw.workers.main import run_worker


@pytest.fixture
def sup():
    workers = WorkersDecl(devices=["cpu", "cpu"], input_arena_mb=1, output_arena_mb=1, threads_per_worker=2,
                          pin_cpus=True, preload=["worker_ext", "/x/ops.so"], cuda_host_memory="staging")
    decl = TracingDecl(exporter="file", path="spans.jsonl")
    s = Supervisor(workers, SupervisorDecl(heartbeat_s=0.5), "ipc:///tmp/back", log_format="json", slow_ms=25.0,
                   tracing=tracing.for_workers(decl, "/etc/tgw"))
    s.prepare()
    yield s
    s.stop()


def test_one_struct_carries_the_whole_start(sup):
    w = sup.workers[1]
    start = decode_start(encode_start(sup.start_for(w)))
    assert start == sup.start_for(w)
    assert (start.worker_id, start.identity, start.segment, start.endpoint, start.device) == \
        (1, "w1.0", w.segment.name, "ipc:///tmp/back", "cpu")
    assert (start.input_bytes, start.output_bytes, start.threads, start.cpus) == (1 << 20, 1 << 20, 2, w.cpus)
    assert (start.heartbeat_s, start.preload, start.host_memory) == (0.5, ["worker_ext", "/x/ops.so"], "staging")
    assert (start.log_format, start.slow_ms) == ("json", 25.0)
    assert start.tracing["exporter"] == "file" and start.tracing["path"] == "/etc/tgw/spans.jsonl"  # resolved


def test_the_broker_sets_nothing_in_its_own_environment():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    before = dict(os.environ)
    try:
        logs.setup("json")
        assert logs.format_in_use() == "json"
        assert logs.slow_requests(5.0) is not None and logs.slow_requests(None) is None
        assert tracing.install(None, None, "/") is None
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert dict(os.environ) == before   # the workers get all of it in their WorkerStart
    assert logs.format_in_use() == "text"


@pytest.mark.parametrize("argv, says", [
    ([], "usage: python -m tgw.workers START"),
    (["not json"], "bad start-up argument: JSON is malformed"),
    (['{"worker_id": "zero"}'], "Expected `int`, got `str` - at `$.worker_id`"),
    (['{"worker_id": 0}'], "missing required field `identity`"),
    (['{"worker_id": 0, "identity": "w0.0", "segment": "s", "input_bytes": 1, "output_bytes": 1, '
      '"endpoint": "ipc:///x", "host_memory": "pinned"}'], "`$.host_memory`"),
    (['{"worker_id": 0, "identity": "w0.0", "segment": "s", "input_bytes": 1, "output_bytes": 1, '
      '"endpoint": "ipc:///x", "colour": "red"}'], "unknown field `colour`"),
])
def test_a_bad_start_is_refused_naming_what_is_wrong(argv, says, capsys):
    assert run_worker(argv) == 2
    assert says in capsys.readouterr().err


def test_python_m_tgw_workers_refuses_a_bad_start():
    r = subprocess.run([sys.executable, "-m", "tgw.workers", '{"worker_id": -1, "identity": 3}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "tgw worker: bad start-up argument" in r.stderr and "$.identity" in r.stderr


def test_decode_start_raises_bad_start():
    with pytest.raises(BadStart):
        decode_start("[]")
    assert WorkerStart(worker_id=0, identity="w0.0", segment="s", input_bytes=1, output_bytes=1,
                       endpoint="e").host_memory == "register"   # the config's default


def test_the_hello_reports_the_host_memory_mode_in_effect(sup):
    w = sup.workers[0]
    Handshake(registry=type("R", (), {"startup_specs": lambda self: []})()).hello(
        w, WorkerHello(v=PROTOCOL_VERSION, worker_id=0, pid=1, host_memory="staging"), 0.0)
    assert w.host_memory == "staging"
    assert WorkerHello(v=PROTOCOL_VERSION, worker_id=0, pid=1).host_memory == ""   # a CPU worker's


def test_one_roster_written_by_the_supervisor_read_by_the_broker(model_files, sup):
    with assembled(parse_config(base_config(model_files, "mlp"), base_dir="/", source="test"),
                   roster=sup.workers) as broker:
        assert broker.roster is sup.workers and broker.placement.roster is sup.workers
        old = sup.workers[0]
        old.spawned(None)
        broker.serving.add_worker(old)           # routes only: the roster is the supervisor's to change
        assert broker.roster == sup.workers and len(sup.workers) == 2 and broker.serving.routes[old.identity] is old
        old.exited()
        sup.forget(old)                          # the supervisor's word takes it off both
        assert broker.roster == [sup.workers[0]] and old not in broker.roster
