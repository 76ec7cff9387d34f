"""Shadows and guarded rollouts end to end (docs/ROLLOUT.md, issue 29): a shadow of a harmless
retrain is promoted and one that flips top-1 on 5 % of inputs is rolled back, while every
caller's answer comes from the serving version; a guarded canary that fails is rolled back;
every refusal with its cause; `models diff` and the metrics.

One broker, one model per scenario (each starts at version 1, the base scorer)."""
from __future__ import annotations

import json
import subprocess
import urllib.request
import sys
import tempfile

import numpy as np
import pytest

from conftest import wait_until
from tgw.testing.lifecycle import control
from tgw.testing.rollouts import FEATURES, Callers, decision, save_scorer, scorer_decl
from tgw.testing.child import BrokerProc
from tgw.client import Client
from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import LoadVersion, RolloutPolicy, Scrape, SetTraffic, UnloadVersion

MODELS = ("close", "flip", "canary", "refusals", "faces")


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    d = tmp_path_factory.mktemp("scorers")
    paths = {kind: save_scorer(str(d / f"{kind}.pt"), kind) for kind in ("base", "close", "flip", "broken")}
    cfg = {"model_roots": [str(d)], "models": [scorer_decl(m, paths["base"]) for m in MODELS],
           "workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 4, "output_arena_mb": 4},
           "http": {"port": 0}, "grpc": {"port": 0}}
    b = BrokerProc(cfg, tempfile.mkdtemp(prefix="tgwr-", dir="/tmp")).start()
    yield b, paths
    assert b.stop() == 0, b.output()


def load(b, model: str, path: str, **kw):
    return control(b.address, LoadVersion(v=0, model=model, version=kw.pop("version", "2"), path=path, **kw))


def test_a_shadow_of_a_close_version_is_compared_and_promoted(rollouts):
    b, paths = rollouts
    callers = Callers(b.address, "close", 4).start()
    wait_until(lambda: callers.answered() >= 20, what="traffic before the shadow")
    policy = RolloutPolicy(promote_after_requests=40, max_abs_diff=1e-4, min_top1_agreement=0.99)
    reply = load(b, "close", paths["close"], shadow=0.5, policy=policy)
    assert "shadow" in reply.message and "guarded" in reply.message, reply.message
    made = decision(b.address, "close", "2")
    wait_until(lambda: callers.answered() >= 200, what="traffic after the promotion")
    tally = callers.stop()
    assert made["decision"] == "promote" and made["figures"]["requests"] >= 40, made
    assert made["figures"]["max_abs_diff"] < 1e-4 and made["figures"]["top1_agreement"] == 1.0, made
    assert tally.get("wrong", 0) == 0 and set(tally) == {"ok"}, tally    # within 1e-4 of version 1, always
    with Client(b.address) as c:
        ended = c.status()["rollouts"]["ended_shadows"]
    done = next(s for s in ended if s["model"] == "close")
    assert done["ended"] == "promoted" and done["compared"] >= 40 and done["outputs"]["y"]["max_abs_diff"] > 0
    out = subprocess.run([sys.executable, "-m", "tgw.broker", "models", "diff", "close", "--address", b.address],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "output y:" in out.stdout and "decision: promote 2" in out.stdout, out


def test_a_shadow_that_flips_top1_on_5_percent_is_rolled_back_and_nobody_sees_it(rollouts):
    b, paths = rollouts
    callers = Callers(b.address, "flip", 4, tolerance=1e-5).start()
    wait_until(lambda: callers.answered() >= 20, what="traffic before the shadow")
    policy = RolloutPolicy(promote_after_requests=5000, min_requests=100, min_top1_agreement=0.99)
    load(b, "flip", paths["flip"], shadow=1.0, policy=policy)
    made = decision(b.address, "flip", "2")
    print("flip decision", made)
    tally = callers.stop()
    assert made["decision"] == "rollback" and "top-1 agreement" in made["why"], made
    assert 0.85 < made["figures"]["top1_agreement"] < 0.99, made
    assert tally.get("wrong", 0) == 0, tally          # callers were answered by version 1 throughout
    with Client(b.address) as c:
        meta = c.metadata("flip")[0]
    scrape = control(b.address, Scrape(v=0)).text
    assert [v["version"] for v in meta["versions"]] == ["1"], meta
    assert 'tgw_rollout_decisions_total{decision="rollback",model="flip"} 1.0' in scrape
    assert 'tgw_shadow_requests_total{model="flip",outcome="compared",version="2"}' in scrape


def test_a_guarded_canary_that_fails_is_rolled_back(rollouts):
    b, paths = rollouts
    callers = Callers(b.address, "canary", 2).start()
    policy = RolloutPolicy(promote_after_requests=1000, min_requests=10, max_error_rate=0.05)
    load(b, "canary", paths["broken"], weight=500_000, policy=policy)
    made = decision(b.address, "canary", "2")
    tally = callers.stop()
    assert made["decision"] == "rollback" and "error rate" in made["why"] and made["figures"]["errors"] >= 10, made
    assert tally.get("wrong", 0) == 0 and tally["ok"] > 0, tally
    with Client(b.address) as c:
        assert c.status()["models"]["canary"]["versions"] == {"1": "ready"}


@pytest.mark.parametrize("kw, why", [
    ({"shadow": 0.5, "weight": 10}, "not both"),
    ({"shadow": 1.5}, "fraction in (0, 1]"),
    ({"shadow": 0.0}, "fraction in (0, 1]"),
    ({"policy": RolloutPolicy(promote_after_requests=5)}, "hot swap"),
    ({"weight": 10, "policy": RolloutPolicy(min_top1_agreement=0.9)}, "only for a shadow"),
    ({"weight": 0, "policy": RolloutPolicy()}, "weight above 0"),
    ({"shadow": 0.5, "policy": RolloutPolicy(max_error_rate=2.0)}, "max_error_rate must be a share"),
])
def test_wrong_safe_change_loads_are_refused_and_change_nothing(rollouts, kw, why):
    b, paths = rollouts
    with pytest.raises(TgwError) as err:
        load(b, "refusals", paths["close"], **kw)
    assert err.value.code is Code.INVALID_ARGUMENT and why in err.value.message, err.value.message
    with Client(b.address) as c:
        assert c.status()["models"]["refusals"]["versions"] == {"1": "ready"}


def test_a_shadow_answers_nobody_and_there_is_one_per_model(rollouts):
    b, paths = rollouts
    load(b, "refusals", paths["close"], version="s", shadow=0.1)
    x = np.zeros((1, FEATURES), np.float32)
    with Client(b.address) as c:
        with pytest.raises(TgwError) as named:
            c.infer("refusals", {"x": x}, version="s")
        assert named.value.code is Code.INVALID_ARGUMENT and "is a shadow" in named.value.message
        assert c.infer("refusals", {"x": x})["y"].shape == (1, 10)   # unnamed: version 1 answers
    with pytest.raises(TgwError) as second:
        load(b, "refusals", paths["flip"], version="t", shadow=0.1)
    assert "already has shadow version 's'" in second.value.message
    with pytest.raises(TgwError) as weighed:
        control(b.address, SetTraffic(v=0, model="refusals", weights={"1": 1, "s": 1}))
    assert weighed.value.code is Code.VERSION_NOT_FOUND
    control(b.address, UnloadVersion(v=0, model="refusals", version="s"))
    with Client(b.address) as c:
        ended = [s for s in c.status()["rollouts"]["ended_shadows"] if s["model"] == "refusals"]
    assert ended and ended[-1]["ended"] == "unloaded"


def test_tritonclient_loads_a_guarded_shadow_over_http_and_grpc(rollouts):
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    b, paths = rollouts
    with Client(b.address) as c:
        faces = c.status()
    policy = '{"promote_after_requests": 100000, "max_abs_diff": 1e-4}'   # tritonclient.http sends no parameters
    body = json.dumps({"parameters": {"version": "2", "path": paths["close"], "shadow": 0.25, "policy": policy}})
    with urllib.request.urlopen(urllib.request.Request(f"{faces['http']}/v2/repository/models/faces/load",
                                                       body.encode(), method="POST"), timeout=60) as r:
        assert r.status == 200 and "shadow" in json.loads(r.read())["message"]
    with Client(b.address) as c:
        shadows = c.status()["rollouts"]["shadows"]
        guarded = c.status()["rollouts"]["guarded"]
    assert [(s["model"], s["version"], s["fraction"]) for s in shadows if s["model"] == "faces"] == [("faces", "2", 0.25)]
    assert [g["policy"] for g in guarded if g["model"] == "faces"] == [{"promote_after_requests": 100000,
                                                                       "min_requests": 20, "max_error_rate": 0.01,
                                                                       "max_abs_diff": 1e-4}]
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(faces["grpc"]))

    def grpc_load(**params):   # tritonclient.grpc's load_model sends no parameters: its stub does
        text = {k: service_pb2.ModelRepositoryParameter(**({"int64_param": v} if isinstance(v, int) else
                                                            {"string_param": v})) for k, v in params.items()}
        return stub.RepositoryModelLoad(service_pb2.RepositoryModelLoadRequest(model_name="faces", parameters=text),
                                        timeout=60)
    with pytest.raises(grpc.RpcError) as refused:   # one shadow per model, whichever face
        grpc_load(version="3", path=paths["flip"], shadow="0.5")
    assert "already has shadow version '2'" in refused.value.details()
    with pytest.raises(grpc.RpcError) as bad:
        grpc_load(version="3", path=paths["flip"], weight=5, policy='{"max_error_rate": "high"}')
    assert "parameter policy" in bad.value.details() and "max_error_rate" in bad.value.details()
    stub.RepositoryModelUnload(service_pb2.RepositoryModelUnloadRequest(
        model_name="faces", parameters={"version": service_pb2.ModelRepositoryParameter(string_param="2")}),
        timeout=60)
    with Client(b.address) as c:
        assert c.status()["models"]["faces"]["versions"] == {"1": "ready"}
