"""Failures against a real broker (one for the module): a stage version that raises on its own
warm-up example is refused - by a swap (LoadVersion, what `models load` sends) and by a reload -
with the handler's message and file:line, the old version serving on (and a reload may not give
a kept version new examples); a batch that fails in a
stage is logged once at WARNING with the handler's file:line; a model that raises on mismatched
input lengths answers HTTP 400 naming both shapes, and the same model serves matched ones.
"""
from __future__ import annotations

import json
import os
import tempfile
import textwrap
import urllib.error
import urllib.request

import pytest
import torch
import yaml

from conftest import served, wait_until
from tgw.client import Client
from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import LoadVersion, Reload
from tgw.testing.lifecycle import control

HANDLERS = textwrap.dedent('''\
    class Shout:
        def __call__(self, batch):
            if any(d == b"boom" for d in batch["data"]):
                raise ValueError("boom is not a word")
            return {"data": [d.upper() for d in batch["data"]]}

    class Broken:
        def __call__(self, batch):
            return {"data": [shout(d) for d in batch["data"]]}
    ''')
BYTES = [{"name": "data", "dtype": "bytes", "shape": []}]


class PairSum(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


def line_of(text: str) -> int:
    return next(i for i, line in enumerate(HANDLERS.splitlines(), 1) if text in line)


def config(root: str, text_versions: list[dict], examples: tuple = ({"data": "hello"},)) -> dict:
    pair = {"name": "pair", "versions": [{"version": "1", "path": "models/pair.pt"}],
            "inputs": [{"name": "a", "dtype": "float32", "shape": [-1]}, {"name": "b", "dtype": "float32", "shape": [-1]}],
            "outputs": [{"name": "y", "dtype": "float32", "shape": [-1]}]}
    text = {"name": "text", "versions": text_versions, "inputs": BYTES, "outputs": BYTES,
            "warmup_inputs": list(examples)}
    return {"model_roots": [root], "http": {"port": 0},
            "workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 4, "output_arena_mb": 2},
            "models": [pair, text]}


V1 = [{"version": "1", "handler": "stages/proof.py:Shout"}]


@pytest.fixture(scope="module")
def broker():
    d = os.path.realpath(tempfile.mkdtemp(prefix="tgwfs-", dir="/tmp"))   # ipc paths must stay short
    for sub in ("stages", "models"):
        os.makedirs(os.path.join(d, sub))
    with open(os.path.join(d, "stages", "proof.py"), "w") as f:
        f.write(HANDLERS)
    torch.jit.script(PairSum()).save(os.path.join(d, "models", "pair.pt"))
    yield from served(config(d, V1), d, http=True, root=d)


def shout(b, data: bytes) -> bytes:
    with Client(b.address) as c:
        return bytes(c.infer("text", {"data": [data]}, timeout=30)["data"].ravel()[0])


def versions(b) -> list[tuple[str, str]]:
    with Client(b.address) as c:
        return [(v["version"], v["state"]) for v in c.metadata("text")[0]["versions"]]


def test_a_stage_that_raises_on_its_example_is_refused_by_swap_and_reload_the_old_serving_on(broker):
    where = f"{broker.root}/stages/proof.py:{line_of('shout(d)')}"
    with pytest.raises(TgwError) as info:
        control(broker.address, LoadVersion(v=0, model="text", version="2",
                                            handler=f"{broker.root}/stages/proof.py:Broken"))
    text = info.value.message
    assert "warmup_inputs[0] raised NameError: name 'shout' is not defined" in text and where in text, text
    assert versions(broker) == [("1", "ready")] and shout(broker, b"abc") == b"ABC"

    with open(broker.config_path, "w") as f:
        yaml.safe_dump(config(broker.root, [*V1, {"version": "3", "handler": "stages/proof.py:Broken"}]), f)
    with pytest.raises(TgwError) as info:
        control(broker.address, Reload(v=0))
    assert "NameError" in info.value.message and where in info.value.message, info.value.message
    assert versions(broker) == [("1", "ready")] and shout(broker, b"abc") == b"ABC"

    with open(broker.config_path, "w") as f:   # new examples for a version proven on the old ones
        yaml.safe_dump(config(broker.root, V1, examples=({"data": "boom"},)), f)
    with pytest.raises(TgwError) as info:
        control(broker.address, Reload(v=0))
    assert "models.text.warmup_inputs (versions ['1'] were proven" in info.value.message, info.value.message
    assert versions(broker) == [("1", "ready")]


def test_a_failed_batch_is_logged_once_at_warning_with_the_handlers_file_and_line(broker):
    where = f"{broker.root}/stages/proof.py:{line_of('raise ValueError')}"
    with pytest.raises(TgwError) as info:
        shout(broker, b"boom")
    assert info.value.code is Code.MODEL_EXECUTION_ERROR
    lines = lambda: [ln for ln in broker.output().splitlines() if "text:1 failed" in ln]   # noqa: E731
    wait_until(lines, 30, "the worker's line for the failed batch")
    assert shout(broker, b"after") == b"AFTER"   # the worker served on (and wrote whatever it would)
    got = lines()
    assert len(got) == 1, got
    assert "MODEL_EXECUTION_ERROR" in got[0] and "ValueError: boom is not a word" in got[0] and where in got[0], got


def infer_http(b, a: list[float], bv: list[float]) -> tuple[int, dict]:
    body = {"inputs": [{"name": "a", "shape": [1, len(a)], "datatype": "FP32", "data": a},
                       {"name": "b", "shape": [1, len(bv)], "datatype": "FP32", "data": bv}]}
    req = urllib.request.Request(f"{b.http}/v2/models/pair/infer", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as got:
            return got.status, json.loads(got.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_mismatched_input_lengths_are_the_callers_400_naming_both_shapes(broker):
    status, doc = infer_http(broker, [1, 2, 3], [1, 2, 3, 4, 5])
    assert status == 400, (status, doc)
    assert "model pair:1 rejected its inputs (a [1, 3], b [1, 5]): The size of tensor a (3) must match the size " \
           "of tensor b (5)" in doc["error"], doc
    status, doc = infer_http(broker, [1, 2, 3], [10, 20, 30])
    assert status == 200 and doc["outputs"][0]["data"] == [11, 22, 33], doc
