"""Pipelines end to end (broker/pipeline/): a real broker and workers running plain TorchScript
steps, every answer checked against the same steps computed by hand, over the native socket and
HTTP; visibility (models, metadata, status, /metrics); refusals, a step error, the pipeline's
deadline, a hot swap of one step's model under pipeline traffic, and a runtime unload refused.

Models: add models (tgw.testing.lifecycle, x + k) and a join model z = 2a + b; "fails" and "spin"
from tests/models.py. One broker for the module.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections import Counter

import numpy as np
import pytest

import stages
from tgw.testing.lifecycle import control, model_decl, save_add_model
from conftest import in_parallel, model_entry, wait_until
from tgw.testing.child import BrokerProc
from tgw.client import Client
from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import ListModels, LoadVersion, Status, UnloadVersion

X = np.arange(8, dtype=np.float32).reshape(2, 4)
SPIN_ROUNDS = 3000   # a spin step far longer than the slow pipeline's 150 ms


def step(name: str, model: str, **inputs) -> dict:
    return {"name": name, "model": model, "inputs": inputs}


PIPELINES = [
    {"name": "chain", "version": "7", "inputs": ["x"],
     "steps": [step("first", "a", x="x"), step("second", "b", x="first.y"), step("third", "c", x="second.y")],
     "outputs": {"y": "third.y", "mid": "first.y"}},
    {"name": "diamond", "inputs": ["x"],
     "steps": [step("left", "a", x="x"), step("right", "b", x="x"), step("join", "join", a="left.y", b="right.y")],
     "outputs": {"z": "join.z"}},
    {"name": "failing", "inputs": ["x"],
     "steps": [step("check", "fails", x="x"), step("after", "fails2", x="check.y")], "outputs": {"y": "after.y"}},
    {"name": "slow", "timeout_ms": 150, "inputs": ["x"],
     "steps": [step("spin", "spin", x="x"), step("tail", "tail", x="spin.y")], "outputs": {"y": "tail.y"}},
    {"name": "pair", "inputs": ["a", "b"], "steps": [step("join", "join", a="a", b="b")], "outputs": {"z": "join.z"}},
    {"name": "texts", "inputs": ["data"], "steps": [step("check", "rowfails", data="data"),
                                                     step("shout", "upper", data="check.data")],
     "outputs": {"data": "shout.data"}},
    {"name": "swapped", "inputs": ["x"],
     "steps": [step("pre", "a", x="x"), step("main", "s", x="pre.y")], "outputs": {"y": "main.y"}},
]


@pytest.fixture(scope="module")
def broker(model_files, tmp_path_factory):
    import torch

    root = tmp_path_factory.mktemp("pipeline-models")
    adds = {"a": 1, "b": 10, "c": 100, "s": 1000, "s2": 2000}
    for name, k in adds.items():
        save_add_model(str(root / f"{name}.pt"), k)
    save_add_model(str(root / "tail.pt"), 5)

    class Join(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a * 2 + b
    torch.jit.save(torch.jit.script(Join()), str(root / "join.pt"))
    for name in ("fails", "spin"):
        shutil.copy(model_files[name][0], root / f"{name}.pt")
    shutil.copy(model_files["fails"][0], root / "fails2.pt")

    def entry(like: str, name: str, **extra) -> dict:   # a tests/models.py model under a name of its own
        return {**model_entry(model_files, like), "name": name,
                "versions": [{"version": "1", "path": str(root / f"{name}.pt")}], **extra}

    def x_model(name: str, inputs: list[str], output: str, width: int = 4) -> dict:
        return {"name": name, "versions": [{"version": "1", "path": str(root / f"{name}.pt")}],
                "inputs": [{"name": n, "dtype": "float32", "shape": [width]} for n in inputs],
                "outputs": [{"name": output, "dtype": "float32", "shape": [width]}]}

    models = [model_decl(n, [("1", str(root / f"{n}.pt"))]) for n in ("a", "b", "c", "s")] + [
        x_model("join", ["a", "b"], "z"), entry("fails", "fails"), entry("fails", "fails2"),
        entry("spin", "spin", max_batch_size=1), x_model("tail", ["x"], "y", width=1)]
    os.makedirs(root / "stages")
    shutil.copy(stages.__file__, root / "stages" / "stages.py")   # a stage that fails rows, one that upper-cases
    handler = str(root / "stages" / "stages.py")
    models += [stages.stage_entry(handler, "RowFails", max_batch_size=4, max_delay_us=5_000_000),
               stages.stage_entry(handler, "Upper")]
    cfg = {"model_roots": [str(root)], "models": models, "pipelines": PIPELINES, "http": {"port": 0},
           "workers": {"devices": ["cpu", "cpu"], "threads_per_worker": 1, "input_arena_mb": 8,
                       "output_arena_mb": 4}}
    b = BrokerProc(cfg, tempfile.mkdtemp(prefix="tgwp-", dir="/tmp")).start()
    b.root = root
    with Client(b.address) as c:
        b.http = c.status()["http"]
    yield b
    code = b.stop()
    assert code == 0, f"broker exited {code} on SIGTERM:\n{b.output()}"


@pytest.fixture(scope="module")
def client(broker):
    with Client(broker.address) as c:
        yield c


def http_json(url: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def status(broker) -> Status:
    return control(broker.address, Status(v=0))


# ---- answers ---------------------------------------------------------------------------------

def test_a_chain_answers_as_its_steps_computed_by_hand(client):
    out = client.infer_with_meta("chain", {"x": X})
    assert (out.model, out.version) == ("chain", "7")
    np.testing.assert_array_equal(out.outputs["y"], X + 111)
    np.testing.assert_array_equal(out.outputs["mid"], X + 1)
    only = client.infer("chain", {"x": X}, outputs=["y"], compress=True)
    assert list(only) == ["y"]
    np.testing.assert_array_equal(only["y"], X + 111)


def test_a_diamond_joins_two_branches(client):
    np.testing.assert_array_equal(client.infer("diamond", {"x": X})["z"], 2 * (X + 1) + (X + 10))


def test_many_callers_at_once_each_get_their_own_answer(broker):
    problems = []

    def caller(i: int) -> None:
        with Client(broker.address) as c:
            for j in range(20):
                x = np.full((1, 4), float(i * 100 + j), np.float32)
                z = c.infer("diamond", {"x": x})["z"]
                if not np.array_equal(z, 3 * x + 12):
                    problems.append((i, j, z))
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert problems == []


def test_http_infer_metadata_and_readiness_of_a_pipeline(broker):
    code, doc = http_json(f"{broker.http}/v2/models/chain/infer", {"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [2, 4], "data": X.ravel().tolist()}]})
    assert code == 200, doc
    got = {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in doc["outputs"]}
    np.testing.assert_array_equal(got["y"], X + 111)
    assert doc["model_name"] == "chain" and doc["model_version"] == "7"
    code, meta = http_json(f"{broker.http}/v2/models/diamond")
    assert code == 200 and meta["platform"] == "tgw_pipeline" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["outputs"] == [{"name": "z", "datatype": "FP32", "shape": [-1, 4]}]
    assert [s["name"] for s in meta["parameters"]["steps"]] == ["left", "right", "join"]
    assert http_json(f"{broker.http}/v2/models/diamond/ready") == (200, {"ready": True})
    code, doc = http_json(f"{broker.http}/v2/models/chain/versions/9/infer", {"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0, 0, 0, 0]}]})
    assert code == 404 and doc["error"] == "Request for unknown model: 'chain' version 9 is not found" and \
        doc["details"]["tgw_message"].startswith("pipeline 'chain' has no version '9'")


# ---- visibility ------------------------------------------------------------------------------

def test_pipelines_are_listed_described_and_counted(broker, client):
    client.infer("chain", {"x": X})
    models = {m.name: m for m in control(broker.address, ListModels(v=0)).models}
    chain = models["chain"]
    assert (chain.versions, chain.default_version, chain.ready, chain.steps) == (["7"], "7", True,
                                                                                 ["first", "second", "third"])
    assert [(t.name, t.dtype, t.shape) for t in chain.inputs] == [("x", "float32", [4])]
    assert sorted(t.name for t in chain.outputs) == ["mid", "y"] and chain.max_batch_size == 16
    assert models["a"].steps == []
    meta = client.metadata("chain")
    assert meta[0]["name"] == "chain" and meta[0]["versions"][0]["format"] == "pipeline"
    st = status(broker).pipelines["chain"]
    assert st["requests"] >= 1 and st["replies"] >= 1 and st["inflight"] == 0 and st["ready"]
    first = st["steps"]["first"]
    assert first["model"] == "a" and first["sent"] == first["ok"] >= 1 and first["failed"] == 0
    assert first["latency_ms"]["p99"] > 0 and first["latency_ms"]["mean"] > 0
    with urllib.request.urlopen(f"{broker.http}/metrics", timeout=30) as r:
        text = r.read().decode()
    assert 'tgw_pipeline_requests_total{code="OK",pipeline="chain"}' in text
    assert 'tgw_pipeline_step_seconds_bucket{le="+Inf",pipeline="chain",step="first"}' in text
    assert 'tgw_pipeline_inflight{pipeline="chain"} 0.0' in text
    cli = subprocess.run([sys.executable, "-m", "tgw.broker", "status", "--address", broker.address],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert re.search(r"^pipeline chain: \d+ requests, \d+ replies, 0 in flight", cli.stdout, re.M), cli.stdout
    assert re.search(r"^  step first +a +sent +\d+  ok +\d+  failed +0  mean [\d.]+ ms  p99 [\d.]+ ms$", cli.stdout,
                     re.M), cli.stdout


# ---- refusals and errors ---------------------------------------------------------------------

@pytest.mark.parametrize("pipeline, inputs, code, expected", [
    ("chain", {"x": X, "w": X}, Code.INVALID_ARGUMENT, "expected 1 inputs but got 2 inputs for model 'chain'. Got "
     "input(s) ['x','w'], but missing required input(s) ]. Please provide all required input(s)."),
    ("chain", {"w": X}, Code.INVALID_ARGUMENT, "unexpected inference input 'w' for model 'chain'"),
    ("pair", {"a": X}, Code.INVALID_ARGUMENT, "expected 2 inputs but got 1 inputs for model 'pair'. Got input(s) "
     "['a'], but missing required input(s) ['b']. Please provide all required input(s)."),
    ("chain", {"x": X.astype(np.float64)}, Code.INVALID_INPUT_DTYPE, "inference input 'x' data-type is 'FP64', but "
     "model 'chain' expects 'FP32'"),
])
def test_bad_inputs_are_refused_naming_the_pipeline(client, pipeline, inputs, code, expected):
    with pytest.raises(TgwError) as info:
        client.infer(pipeline, inputs)
    assert info.value.code is code and expected in info.value.message
    np.testing.assert_array_equal(client.infer("pair", {"a": X, "b": X})["z"], 3 * X)


def test_a_step_error_answers_with_its_code_naming_the_step_and_later_steps_are_not_sent(broker, client):
    np.testing.assert_array_equal(client.infer("failing", {"x": np.ones((1, 2), np.float32)})["y"],
                                  np.full((1, 2), 3, np.float32))
    before = status(broker).models["fails2"]["requests"]
    with pytest.raises(TgwError) as info:
        client.infer("failing", {"x": -np.ones((1, 2), np.float32)})
    err = info.value
    assert err.code is Code.MODEL_EXECUTION_ERROR
    assert err.message.startswith("pipeline failing step check (model fails): ")
    assert (err.details["pipeline"], err.details["step"]) == ("failing", "check")
    assert status(broker).models["fails2"]["requests"] == before
    with pytest.raises(TgwError) as info:   # a shape problem is the first step's admission's
        client.infer("chain", {"x": np.zeros((1, 3), np.float32)})
    assert info.value.code is Code.INVALID_INPUT_SHAPE and "step first (model a)" in info.value.message


def test_a_step_that_would_start_after_the_deadline_is_not_sent(broker, client):
    with pytest.raises(TgwError) as info:
        client.infer("slow", {"x": np.full((1, 1), SPIN_ROUNDS, np.float32)})
    err = info.value
    assert err.code is Code.DEADLINE_EXCEEDED, err
    assert err.message.startswith("pipeline slow step tail (model tail): the pipeline's deadline passed")
    assert status(broker).models["tail"]["requests"] == 0
    steps = status(broker).pipelines["slow"]["steps"]
    assert steps["spin"]["ok"] == 1 and "tail" not in steps


def test_unloading_a_model_a_pipeline_needs_is_refused(broker):
    with pytest.raises(TgwError) as info:
        control(broker.address, UnloadVersion(v=0, model="b"))
    assert info.value.code is Code.INVALID_ARGUMENT
    assert "pipeline 'chain' step 'second' uses b and no version would be left" in info.value.message


# ---- a hot swap inside a pipeline ------------------------------------------------------------

def test_a_hot_swap_of_a_step_under_pipeline_traffic_fails_nothing(broker):
    stop = threading.Event()
    tallies = [Counter() for _ in range(4)]

    def caller(i: int) -> None:
        x = np.full((1, 4), float(i), np.float32)
        last = 0
        with Client(broker.address) as c:
            while not stop.is_set():
                try:
                    y = c.infer("swapped", {"x": x}, timeout=10.0)["y"]
                except TgwError as err:
                    tallies[i][f"error {err.code.value}: {err.message}"] += 1
                    continue
                k = int(round(float(y[0, 0] - x[0, 0]))) - 1
                tallies[i][f"version {k}"] += 1
                if k < last:
                    tallies[i]["went back"] += 1
                last = max(last, k)
    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: all(t["version 1000"] >= 5 for t in tallies), what=f"traffic on the old version {tallies}")
        reply = control(broker.address, LoadVersion(v=0, model="s", version="2", path=str(broker.root / "s2.pt")),
                        timeout_s=120)
        assert "s:2 serves every request" in reply.message
        wait_until(lambda: all(t["version 2000"] >= 5 for t in tallies), what=f"traffic on the new version {tallies}")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    total = sum(tallies, Counter())
    assert set(total) == {"version 1000", "version 2000"}, total


# ---- a stage inside a pipeline ---------------------------------------------------------------

def test_a_row_its_stage_fails_answers_its_request_alone_and_the_batch_goes_on(broker):
    """Four callers' texts decoded as one batch of the first stage; the bad one is answered
    INVALID_ARGUMENT naming the step, the three others go on to the next stage."""
    rows = [b"one", b"two", b"bad row", b"four"]
    out = in_parallel(broker.address, "texts", rows)
    for row, result in zip(rows, out):
        if row == b"bad row":
            assert isinstance(result, TgwError) and result.code is Code.INVALID_ARGUMENT, result
            assert re.fullmatch(r"pipeline texts step check \(model rowfails\): stage rowfails: row [0-3] starts "
                                r"with 'bad': b'bad row'", result.message), result.message
            assert (result.details["pipeline"], result.details["step"]) == ("texts", "check")
        else:
            assert not isinstance(result, TgwError), result
            assert [bytes(v) for v in result["data"].ravel()] == [row.upper()]
    steps = status(broker).pipelines["texts"]["steps"]
    assert (steps["check"]["sent"], steps["check"]["ok"], steps["check"]["failed"]) == (4, 3, 1)
    assert steps["shout"]["sent"] == 3
