"""SIGHUP and `tgw-broker reload` (broker/models/reload.py) end to end: the config file's difference is
applied while serving; an invalid file, a failed load or a change that needs a restart
changes nothing, and the reason is logged and shown by `tgw-broker status`. Also the rule that
control ops need authentication on a tcp:// listener."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import yaml

from tgw.testing.child import BrokerProc
from tgw.testing.lifecycle import control, model_decl, save_add_model, version_of
from tgw.broker.models.operator import unauthenticated
from tgw.broker.config.schema import ServerDecl
from tgw.client import Client
from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import Reload

X = np.zeros((1, 4), np.float32)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    d = tmp_path_factory.mktemp("reload_models")
    for k in range(1, 5):
        save_add_model(str(d / f"add{k}.pt"), k)
    return d


def config(root, models: list[dict]) -> dict:
    return {"model_roots": [str(root)], "models": models,
            "workers": {"devices": ["cpu"], "input_arena_mb": 4, "output_arena_mb": 4}}


@pytest.fixture
def served(root):
    b = BrokerProc(config(root, [model_decl("m", [("1", str(root / "add1.pt"))])]),
                   tempfile.mkdtemp(prefix="tgwr-", dir="/tmp")).start()
    yield b
    assert b.stop() == 0, b.output()


def rewrite(b: BrokerProc, cfg: dict) -> None:
    with open(b.config_path, "w") as f:
        yaml.safe_dump(cfg, f)


def sighup_and_wait(b: BrokerProc) -> dict:
    """Send SIGHUP; the reload outcome status shows once the broker has finished with it."""
    with Client(b.address) as c:
        before = c.status()["reload"].get("at_s")
    os.kill(b.pid, signal.SIGHUP)

    def outcome():
        with Client(b.address) as c:
            r = c.status()["reload"]
        return r if r.get("at_s") != before else None
    b.wait_for(outcome, 60, "the reload outcome in status")
    return outcome()


def answer(address: str, model: str, **kw) -> int:
    with Client(address) as c:
        return version_of(X, c.infer(model, {"x": X}, **kw)["y"])


def test_sighup_applies_the_difference(served, root):
    m = model_decl("m", [("1", str(root / "add1.pt")), ("2", str(root / "add2.pt"))])
    m["versions"][1]["weight"] = 1   # version 2 takes everything; 1 stays loaded for callers that name it
    rewrite(served, config(root, [m, model_decl("n", [("3", str(root / "add3.pt"))], timeout_ms=5000)]))
    outcome = sighup_and_wait(served)
    assert outcome["ok"], outcome
    assert "models added ['n']" in outcome["message"] and "m:2" in outcome["message"]
    assert answer(served.address, "m") == 2 and answer(served.address, "m", version="1") == 1
    assert answer(served.address, "n") == 3
    with Client(served.address) as c:
        meta = {m["name"]: m for m in c.metadata()}
    assert [(v["version"], v["weight"]) for v in meta["m"]["versions"]] == [("1", 0), ("2", 1)]

    # the file drops model n and version 1: they drain and unload; reload over the socket this time
    rewrite(served, config(root, [model_decl("m", [("2", str(root / "add2.pt"))])]))
    reply = control(served.address, Reload(v=0))
    assert "models removed ['n']" in reply.message and "m:1" in reply.message, reply.message
    with Client(served.address) as c, pytest.raises(TgwError) as info:
        c.infer("n", {"x": X})
    assert info.value.code is Code.MODEL_NOT_FOUND
    assert answer(served.address, "m") == 2
    with Client(served.address) as c:
        assert [v["version"] for v in c.metadata("m")[0]["versions"]] == ["2"]
        loaded = c.status()["workers"][0]["models"]
    assert loaded == ["m:2"]   # unloaded from the worker, not just unrouted


@pytest.mark.parametrize("case", ["invalid", "needs_restart"])
def test_a_bad_reload_changes_nothing_and_says_why(served, root, case):
    if case == "invalid":   # every problem of the file, as at start-up
        cfg = config(root, [model_decl("m", [("1", str(root / "add1.pt")), ("2", str(root / "missing.pt"))])])
        words = "model file not found"
    else:
        cfg = config(root, [model_decl("m", [("1", str(root / "add1.pt"))], max_batch_size=4)])
        words = "models.m.max_batch_size"
    rewrite(served, cfg)
    outcome = sighup_and_wait(served)
    assert not outcome["ok"] and words in outcome["message"], outcome
    assert "nothing changed" in outcome["message"]
    assert answer(served.address, "m") == 1
    with Client(served.address) as c:
        assert [v["version"] for v in c.metadata("m")[0]["versions"]] == ["1"]
    r = subprocess.run([sys.executable, "-m", "tgw.broker", "status", "--address", served.address],
                       capture_output=True, text=True, timeout=60)
    assert "FAILED" in r.stdout and words in r.stdout, r.stdout
    assert words in served.output()   # and logged


def test_a_reload_whose_new_version_fails_warm_up_takes_it_out_again(served, root, tmp_path):
    import torch

    class Narrow(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, :1]
    torch.jit.save(torch.jit.script(Narrow()), str(root / "narrow.pt"))
    rewrite(served, config(root, [model_decl("m", [("1", str(root / "add1.pt")), ("2", str(root / "narrow.pt"))]),
                                  model_decl("n", [("3", str(root / "add3.pt"))])]))
    outcome = sighup_and_wait(served)
    assert not outcome["ok"] and "warmup" in outcome["message"], outcome
    assert answer(served.address, "m") == 1
    with Client(served.address) as c:
        assert [m["name"] for m in c.metadata()] == ["m"]              # n was taken out again too
        assert c.status()["workers"][0]["models"] == ["m:1"]


def test_control_ops_need_authentication_on_tcp():
    assert unauthenticated("tcp://127.0.0.1:5555", ServerDecl(curve_secret_key_file="k"))
    assert not unauthenticated("tcp://127.0.0.1:5555", ServerDecl(curve_secret_key_file="k", auth_token_file="t"))
    assert not unauthenticated("ipc:///run/tgw/tgw.sock", ServerDecl())
