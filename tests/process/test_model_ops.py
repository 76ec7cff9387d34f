"""Model lifecycle end to end (issue 10): hot swap under load, canary split and sticky keys,
unload memory, every refusal with its cause, a worker restart after a swap, and the CLI verbs.

Real broker, real workers, real TorchScript files: model "m" version k returns x + k, so every
reply names its own version. TGW_SLOW=1 runs the swap at the issue's size (32 callers, 30 s)
and the canary over 20,000 requests; the default run is smaller and checks the same rules.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from tgw.testing.child import BrokerProc
from tgw.testing.lifecycle import canary, control, model_decl, save_add_model, swap, unload_rss, version_of
from tgw.broker.config.load import file_sha256
from tgw.client import Client
from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import LoadVersion, SetTraffic, UnloadVersion

SLOW = os.environ.get("TGW_SLOW") == "1"
X = np.zeros((1, 4), np.float32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The model root: add1..add5.pt, big.pt (64 MiB), wrong.pt (fails warm-up), junk.pt (no model),
    link.pt (a symlink out of the root)."""
    d = tmp_path_factory.mktemp("roots")
    root = d / "models"
    root.mkdir()
    for k in range(1, 6):
        save_add_model(str(root / f"add{k}.pt"), k)
    save_add_model(str(root / "big.pt"), 7, pad_floats=16 << 20)
    import torch

    class Wrong(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, :2]     # declared [4]: warm-up refuses it
    torch.jit.save(torch.jit.script(Wrong()), str(root / "wrong.pt"))
    (root / "junk.pt").write_bytes(b"not a TorchScript archive")
    outside = d / "outside.pt"
    save_add_model(str(outside), 9)
    (root / "link.pt").symlink_to(outside)
    return root


def broker(models, workers: int = 1, **extra) -> BrokerProc:
    cfg = {"model_roots": [str(models)],
           "workers": {"devices": ["cpu"] * workers, "input_arena_mb": 4, "output_arena_mb": 4},
           "models": [model_decl("m", [("1", str(models / "add1.pt"))], **extra)]}
    return BrokerProc(cfg, tempfile.mkdtemp(prefix="tgwl-", dir="/tmp")).start()


@pytest.fixture
def one(models):
    b = broker(models)
    yield b
    assert b.stop() == 0, b.output()


def infer_version(address: str, **kw) -> int:
    with Client(address) as c:
        return version_of(X, c.infer("m", {"x": X}, **kw)["y"])


@pytest.mark.slow
def test_hot_swap_under_load_fails_nothing_and_versions_only_move_forward(one, models):
    concurrency, seconds = (32, 30.0) if SLOW else (8, 4.0)
    r = swap(one.address, "m", [("2", str(models / "add2.pt")), ("3", str(models / "add3.pt"))],
             concurrency=concurrency, duration_s=seconds, per_phase=200)
    print("swap:", r)
    assert r["failed"] == 0, r["errors"]
    assert r["backward_count"] == 0, r["backward"]   # per caller, the version never goes back
    assert set(r["by_version"]) == {"1", "2", "3"} and r["ok"] == r["requests"]
    meta = Client(one.address).metadata("m")[0]
    assert [(v["version"], v["state"]) for v in meta["versions"]] == [("3", "ready")]
    assert infer_version(one.address) == 3


def test_a_swap_on_two_workers_loads_on_both_before_it_flips(models):
    b = broker(models, workers=2)
    try:
        r = swap(b.address, "m", [("2", str(models / "add2.pt"))], concurrency=4, duration_s=1.0, per_phase=100)
        assert r["failed"] == 0 and r["backward_count"] == 0 and set(r["by_version"]) == {"1", "2"}, r
        load_events = [e for e in r["swaps"][0]["events"] if e["event"] == "load"]
        assert sorted(e["worker"] for e in load_events) == ["worker0[cpu]", "worker1[cpu]"]
        with Client(b.address) as c:
            assert [w["models"] for w in c.status()["workers"]] == [["m:2"], ["m:2"]]
    finally:
        assert b.stop() == 0, b.output()


def test_unloading_every_version_then_loading_the_declared_one_again(one):
    control(one.address, UnloadVersion(v=0, model="m"))
    with Client(one.address) as c:
        with pytest.raises(TgwError) as info:
            c.infer("m", {"x": X})
        assert info.value.code is Code.MODEL_NOT_READY and info.value.details["reason"] == "no_version"
        assert c.health()["models"]["m"] is False and c.status()["workers"][0]["models"] == []
    reply = control(one.address, LoadVersion(v=0, model="m", version="1"))   # the config's path
    assert "m:1 serves every request" in reply.message
    assert infer_version(one.address) == 1


@pytest.mark.slow
def test_canary_split_is_within_a_point_and_a_half_and_keys_stay_on_one_version(models):
    b = broker(models)
    try:
        control(b.address, LoadVersion(v=0, model="m", version="2", path=str(models / "add2.pt"), weight=10))
        control(b.address, SetTraffic(v=0, model="m", weights={"1": 90, "2": 10}))
        r = canary(b.address, "m", n=20_000 if SLOW else 4_000, keys=200)
        print("canary:", r)
        assert abs(r["share"][1] - 90) <= 1.5 and abs(r["share"][2] - 10) <= 1.5
        assert r["keys_on_two_versions"] == 0 and set(r["keys_by_version"]) == {1, 2}
    finally:
        assert b.stop() == 0, b.output()


def test_unloading_a_version_gives_its_memory_back(one, models):
    r = unload_rss(one.address, "m", "big", str(models / "big.pt"))
    print("unload RSS:", r)
    assert r["model_bytes"] >= 64 << 20
    assert r["rss_after_load"] - r["rss_before_load"] > 32 << 20                         # the load was real
    assert abs(r["rss_after_unload"] - r["rss_before_load"]) <= 0.10 * r["rss_before_load"]


def refusal(address: str, msg) -> TgwError:
    with pytest.raises(TgwError) as info:
        control(address, msg)
    return info.value


def test_every_refusal_names_its_cause_and_the_old_version_keeps_serving(one, models):
    a, path = one.address, lambda name: str(models / name)
    cases = [
        (LoadVersion(v=0, model="m", version="2", path=path("missing.pt")), Code.INVALID_ARGUMENT, "not found"),
        (LoadVersion(v=0, model="m", version="2", path="/etc/hostname"), Code.INVALID_ARGUMENT, "outside model_roots"),
        (LoadVersion(v=0, model="m", version="2", path=f"{models}/../models/add2.pt"), Code.INVALID_ARGUMENT, "'..'"),
        (LoadVersion(v=0, model="m", version="2", path=path("link.pt")), Code.INVALID_ARGUMENT, "symlink"),
        (LoadVersion(v=0, model="m", version="2", path=path("add2.pt"), sha256="0" * 64), Code.INVALID_ARGUMENT,
         "sha256"),
        (LoadVersion(v=0, model="m", version="2", path=path("junk.pt")), Code.INVALID_ARGUMENT, "not a zip archive"),
        (LoadVersion(v=0, model="m", version="2", path=path("wrong.pt")), Code.MODEL_EXECUTION_ERROR, "warmup"),
        (LoadVersion(v=0, model="m", version="1", path=path("add2.pt")), Code.INVALID_ARGUMENT, "already has"),
        (LoadVersion(v=0, model="m", version="2"), Code.INVALID_ARGUMENT, "give its path"),
        (LoadVersion(v=0, model="nope", version="2", path=path("add2.pt")), Code.MODEL_NOT_FOUND, "nope"),
        (UnloadVersion(v=0, model="m", version="7"), Code.VERSION_NOT_FOUND, "no version '7'"),
        (SetTraffic(v=0, model="m", weights={"1": 50, "7": 50}), Code.VERSION_NOT_FOUND, "'7'"),
        (SetTraffic(v=0, model="m", weights={"1": 0}), Code.INVALID_ARGUMENT, "sum to more than 0"),
    ]
    for msg, code, words in cases:
        err = refusal(a, msg)
        assert err.code is code and words in err.message, (msg, err)
        assert infer_version(a) == 1, msg   # nothing changed
    with Client(a) as c:
        meta = c.metadata("m")[0]
    assert [(v["version"], v["state"], v["weight"]) for v in meta["versions"]] == [("1", "ready", 100)]
    # the same sha256 the config would give is accepted: the worker checks it on the bytes it loads
    control(a, LoadVersion(v=0, model="m", version="2", path=path("add2.pt"), sha256=file_sha256(path("add2.pt"))))
    assert infer_version(a) == 2


def test_a_swapped_in_version_survives_its_worker_restart(one, models):
    control(one.address, LoadVersion(v=0, model="m", version="4", path=str(models / "add4.pt")))
    old = one.worker_pids()
    os.kill(old[0], signal.SIGKILL)
    one.wait_for(lambda: one.worker_pids() and one.worker_pids() != old and infer_version(one.address) == 4, 60,
                 "the restarted worker serving version 4")
    with Client(one.address) as c:
        assert c.metadata("m")[0]["default_version"] == "4"


def tgw_broker(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tgw.broker", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def on_a_terminal(*args: str, cwd=None) -> tuple[int, str, str]:
    """`tgw-broker ARGS` with stderr on a pseudo-terminal: (exit status, stdout, what the terminal got)."""
    import pty
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "tgw.broker", *args], stdout=subprocess.PIPE,
                                stderr=follower, text=True, cwd=cwd)
    finally:
        os.close(follower)
    terminal = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:   # EIO: every writer of the terminal has gone
            break
        if not chunk:
            break
        terminal += chunk
    os.close(leader)
    out = proc.stdout.read()
    return proc.wait(timeout=120), out, terminal.decode(errors="replace")


def test_cli_verbs_against_a_running_broker(one, models):
    a = ["--address", one.address]
    r = tgw_broker("models", "load", "m", "--version", "5", "--path", str(models / "add5.pt"), "--weight", "25", *a)
    assert r.returncode == 0 and "m:5 loaded with weight 25" in r.stdout, r.stderr
    r = tgw_broker("models", "traffic", "m", "1=75", "5=25", *a)
    assert r.returncode == 0 and "75.0%" in r.stdout, r.stderr
    r = tgw_broker("models", "list", *a)
    assert r.returncode == 0 and "1 ready 75%" in r.stdout and "5 ready 25%" in r.stdout, r.stdout
    r = tgw_broker("models", "metadata", "m", "--json", *a)
    assert r.returncode == 0 and '"residency": "always"' in r.stdout
    r = tgw_broker("models", "unload", "m", "--version", "1", *a)
    assert r.returncode == 0 and "drained and unloaded" in r.stdout, r.stderr
    assert infer_version(one.address) == 5
    r = tgw_broker("models", "load", "m", "--version", "6", "--path", "/etc/hostname", *a)
    assert r.returncode == 1 and "outside model_roots" in r.stderr
    with Client(one.address) as c:
        assert c.status()["events"][-1]["event"] == "unload"


def test_cli_takes_relative_paths_and_finds_the_broker_from_its_config(one, models, tmp_path):
    """Issue 39: a relative --path is taken from the current directory, as the config takes its
    own; a path outside model_roots is still refused with the broker's reason; `--config` finds
    the broker from the config's server.address; on a terminal `models load` says when it is ready."""
    import yaml
    config = yaml.safe_load(open(one.config_path))
    config.setdefault("server", {})["address"] = one.address
    (tmp_path / "tgw.yaml").write_text(yaml.safe_dump(config))
    c = ["--config", str(tmp_path / "tgw.yaml")]
    r = tgw_broker("models", "load", "m", "--version", "2", "--path", "add2.pt", *c, cwd=models)
    assert r.returncode == 0 and "m:2 serves every request" in r.stdout, r.stderr
    assert infer_version(one.address) == 2
    r = tgw_broker("models", "load", "m", "--version", "3", "--path", "outside.pt", *c, cwd=models.parent)
    assert r.returncode == 1 and f"{models.parent / 'outside.pt'} is outside model_roots" in r.stderr, r.stderr
    r = tgw_broker("status", *c)
    assert r.returncode == 0 and r.stdout.startswith(f"{one.address}: serving"), r.stderr
    code, out, terminal = on_a_terminal("models", "load", "m", "--version", "4", "--path", "add4.pt", *c, cwd=models)
    assert code == 0 and "m:4 serves every request" in out, terminal
    assert "m:4 ready after " in terminal and "Traceback" not in terminal
    r = tgw_broker("models", "load", "m", "--version", "5", "--path", "add5.pt", *c, cwd=models)
    assert r.returncode == 0 and "ready after" not in r.stderr + r.stdout   # not a terminal: quiet


def test_a_version_whose_file_went_is_dropped_when_a_restarted_worker_cannot_load_it(one, models, tmp_path):
    import shutil
    doomed = models / "doomed.pt"
    shutil.copy(models / "add3.pt", doomed)
    control(one.address, LoadVersion(v=0, model="m", version="3", path=str(doomed), weight=10))
    doomed.unlink()                                  # e.g. an operator cleaning up the model folder
    old = one.worker_pids()
    os.kill(old[0], signal.SIGKILL)

    def serving_again() -> bool:
        with Client(one.address) as c:
            meta = c.metadata("m")[0]
            return [v["version"] for v in meta["versions"]] == ["1"] and c.health()["ready"]
    one.wait_for(serving_again, 90, "version 3 dropped and the worker serving version 1")
    assert {infer_version(one.address) for _ in range(20)} == {1}
    with Client(one.address) as c:
        events = c.status()["events"]
        assert c.status()["workers"][0]["restarts"] == 2   # the kill, then one failed start: no crash loop
    assert any(e["event"] == "load_failed" and e["version"] == "3" and e["reason"] == "restart" for e in events)
    assert "m:3 dropped" in one.output()
