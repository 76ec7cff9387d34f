"""Replay warm-up end to end (issue 29): real traffic at two shapes, then a version loaded beside
the serving one - by a hot swap, and by residency after an eviction - is warmed with every shape
at the batch sizes seen, as its load event shows; payloads are kept and sent only with
warmup.replay_payloads; a reload changes the warmup section; replay off leaves the declared sizes.

The model sleeps 20 ms on its first call per shape (tgw.testing.slow_first, preloaded by the
workers). One caller sends one request at a time, so each request is a batch of its own rows."""
from __future__ import annotations

import tempfile

import numpy as np
import pytest
import yaml

from tgw.testing.lifecycle import control
from tgw.testing.slow_first import IO, save_slow_first
from tgw.testing.child import BrokerProc
from tgw.client import Client
from tgw.shm.wire import LoadVersion, Reload

PRELOAD = "tgw.testing.slow_first"
TRAFFIC = [(1, 16), (3, 32), (1, 16), (3, 32)]   # (rows, width) of each request, in order
PAD = 1 << 20   # 4 MiB of zeros: two on-demand models do not fit a 6 MiB budget


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    d = tmp_path_factory.mktemp("warmup_models")
    for k in (1, 2, 3):
        save_slow_first(str(d / f"slow{k}.pt"), k, ms=20.0)
    for name in ("a", "b"):
        save_slow_first(str(d / f"{name}.pt"), 1, ms=20.0, pad_floats=PAD)
    return d


def decl(name: str, path, **extra) -> dict:
    return {"name": name, "versions": [{"version": "1", "path": str(path)}], "max_batch_size": 8, **IO, **extra}


def broker(root, models: list[dict], warmup: dict, **workers) -> BrokerProc:
    cfg = {"model_roots": [str(root)], "warmup": warmup, "models": models,
           "workers": {"devices": ["cpu"], "input_arena_mb": 4, "output_arena_mb": 4, "preload": [PRELOAD],
                       **workers}}
    return BrokerProc(cfg, tempfile.mkdtemp(prefix="tgww-", dir="/tmp")).start()


def send(address: str, model: str = "slow", traffic=TRAFFIC) -> None:
    with Client(address) as c:
        for rows, width in traffic:
            x = np.ones((rows, width), np.float32)
            assert c.infer(model, {"x": x}, timeout=30)["y"].shape == (rows, width)


def replay_sample(address: str, model: str = "slow") -> dict:
    with Client(address) as c:
        return c.status()["models"][model]["replay"]


def loaded(events: list[dict], model: str, version: str) -> dict:
    [event] = [e for e in events if e["event"] == "load" and (e["model"], e["version"]) == (model, version)]
    return event


def covered(event: dict) -> list[tuple[int, list]]:
    return [(b["rows"], b["shapes"]) for b in event["replay"]["covered"]]


def test_a_hot_swap_replays_every_shape_at_the_batch_sizes_seen_and_no_payload(root):
    b = broker(root, [decl("slow", root / "slow1.pt")], {"samples": 8})
    try:
        send(b.address)
        assert replay_sample(b.address) == {"samples": 2, "payload_bytes": 0}
        reply = control(b.address, LoadVersion(v=0, model="slow", version="2", path=str(root / "slow2.pt")))
        event = loaded(reply.details["events"], "slow", "2")
        replay = event["replay"]
        assert covered(event) == [(3, [[32]]), (1, [[16]])]   # newest first
        assert replay["settled"] and replay["rounds"] >= 2 and len(replay["p99_ms"]) == replay["rounds"]
        assert replay["payloads"] is False and all(not b["payload"] for b in replay["covered"])
        with Client(b.address) as c:
            out = c.infer_with_meta("slow", {"x": np.ones((1, 16), np.float32)})
            assert out.version == "2" and float(out.outputs["y"][0, 0]) == 4.0   # 2x + 2
        [line] = [ln for ln in b.output().splitlines() if "loaded slow:2" in ln]
        assert f"replay warm-up: {replay['rounds']} round(s) of 2 batch(es)" in line and "settled" in line
    finally:
        assert b.stop() == 0, b.output()


def test_payloads_only_when_configured_and_a_reload_turns_replay_off(root):
    models = [decl("slow", root / "slow1.pt")]
    b = broker(root, models, {"replay_payloads": True})
    try:
        send(b.address, traffic=[(2, 4)])
        assert replay_sample(b.address) == {"samples": 1, "payload_bytes": 2 * 4 * 4}
        reply = control(b.address, LoadVersion(v=0, model="slow", version="2", path=str(root / "slow2.pt")))
        assert loaded(reply.details["events"], "slow", "2")["replay"]["payloads"] is True
        served = [{**models[0], "versions": [{"version": "2", "path": str(root / "slow2.pt")}]}]
        with open(b.config_path) as f:
            cfg = yaml.safe_load(f)
        with open(b.config_path, "w") as f:
            yaml.safe_dump({**cfg, "models": served, "warmup": {"replay": False}}, f)
        assert "warmup changed ['replay', 'replay_payloads']" in control(b.address, Reload(v=0)).message
        assert replay_sample(b.address) == {"samples": 0, "payload_bytes": 0}
        send(b.address, traffic=[(2, 4)])
        reply = control(b.address, LoadVersion(v=0, model="slow", version="3", path=str(root / "slow3.pt")))
        assert "replay" not in loaded(reply.details["events"], "slow", "3")   # the declared sizes only
    finally:
        assert b.stop() == 0, b.output()


def test_an_on_demand_model_loaded_again_after_its_eviction_replays_its_traffic(root):
    models = [decl(n, root / f"{n}.pt", residency="on_demand") for n in ("a", "b")]
    b = broker(root, models, {}, max_model_memory=6 << 20)
    try:
        send(b.address, "a", [(1, 16), (2, 8)])   # a's first load: no traffic yet, nothing to replay
        send(b.address, "b", [(1, 4)])             # evicts a
        send(b.address, "a", [(1, 16)])            # a again, warmed with what it served before
        with Client(b.address) as c:
            events = c.status()["events"]
        loads = [e for e in events if e["event"] == "load" and e["model"] == "a"]
        assert [e["event"] for e in events if e["model"] == "a"] == ["load", "evict", "unload", "load"]
        assert "replay" not in loads[0] and covered(loads[1]) == [(2, [[8]]), (1, [[16]])]
    finally:
        assert b.stop() == 0, b.output()
