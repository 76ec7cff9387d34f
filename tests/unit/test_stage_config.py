"""Stages in the config (broker/config/load.py, roots.py) and where they run (broker/models/roles.py,
placement, the handshake): a handler file is confined to model_roots like a model file, checked
(exists, sha256, defines its class: parsed, never run), and made absolute; the spec a worker
loads carries handler, device and options; each worker loads what its role holds."""
from __future__ import annotations

import hashlib
import os
import shutil

import pytest

import stages
from tgw.broker.config.load import ConfigError, parse_config
from tgw.broker.fleet.handshake import Handshake
from tgw.broker.models.placement import Placement
from tgw.broker.models.registry import Registry
from tgw.broker.models.roles import placement_problems, roles_for, serves
from tgw.shm.wire import WorkerHello

HANDLER = os.path.abspath(stages.__file__)


@pytest.fixture
def base(tmp_path):
    """A config folder: models/stages.py (a copy of tests/stages.py) and models/m.pt."""
    root = tmp_path.resolve()
    (root / "models").mkdir()
    shutil.copy(HANDLER, root / "models" / "stages.py")
    from conftest import unloaded_model
    unloaded_model(root / "models" / "m.pt")
    return root


def config(*models, **workers) -> dict:
    return {"model_roots": ["models"], "workers": {"devices": ["cpu"], **workers},
            "models": [{"name": "m", "versions": [{"version": "1", "path": "models/m.pt"}],
                        "inputs": [{"name": "x", "dtype": "float32", "shape": [4]}],
                        "outputs": [{"name": "y", "dtype": "float32", "shape": [4]}]}, *models]}


def stage(cls: str = "Echo", handler: str = "models/stages.py", **more) -> dict:
    return stages.stage_entry(handler, cls, **more)


def problems(data, base) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, str(base))
    return str(info.value)


def test_a_handler_file_is_confined_and_made_absolute(base):
    cfg = parse_config(config(stage(options={"tag": "x"}, device="cpu")), str(base))
    v = cfg.model("echo").versions[0]
    assert v.handler == f"{base}/models/stages.py:Echo" and v.format == "stage" and v.path is None
    spec = Registry(cfg.models).models["echo"].spec(Registry(cfg.models).models["echo"].records["1"])
    assert (spec.format, spec.handler, spec.device, spec.options, spec.path) == \
        ("stage", v.handler, "cpu", {"tag": "x"}, "")
    model = Registry(cfg.models).models["m"]
    assert model.spec(model.records["1"]).device == "" and model.spec(model.records["1"]).options == {}


def test_a_module_handler_is_left_to_the_worker(base):
    cfg = parse_config(config(stage(handler="tgw.workers.no_such_module")), str(base))
    assert cfg.model("echo").versions[0].handler == "tgw.workers.no_such_module:Echo"


def test_sha256_of_a_handler_file(base):
    digest = hashlib.sha256((base / "models" / "stages.py").read_bytes()).hexdigest()
    ok = stage(versions=[{"version": "1", "handler": "models/stages.py:Echo", "sha256": digest}])
    assert parse_config(config(ok), str(base)).model("echo").versions[0].sha256 == digest
    bad = stage(versions=[{"version": "1", "handler": "models/stages.py:Echo", "sha256": "0" * 64}])
    assert "models.1.versions.0.sha256: sha256 does not match" in problems(config(bad), base)


def test_bad_handlers_are_refused_with_their_key_path(base, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside").resolve() / "evil.py"
    outside.write_text("class Echo: pass\n")
    os.symlink(outside, base / "models" / "link.py")
    (base / "models" / "broken.py").write_text("class Echo(:\n")
    cases = {
        str(outside): "is outside model_roots",
        "models/link.py": "is a symlink that resolves to",
        "models/missing.py": "handler file not found",
        "models/broken.py": "is not valid Python (line 1",
        "models/../models/stages.py": "contains '..'",
    }
    for path, why in cases.items():
        text = problems(config(stage(handler=path)), base)
        assert "models.1.versions.0.handler: " in text and why in text, (path, text)
    text = problems(config(stage(versions=[{"version": "1", "handler": "models/stages.py:NoSuchStage"}])), base)
    assert "models.1.versions.0.handler: handler file" in text and "defines no 'NoSuchStage'" in text


def test_stage_keys_and_bytes_belong_to_stages(base):
    model = config()["models"][0]
    assert "device, options and warmup_inputs are a stage's keys" in problems(
        {**config(), "models": [{**model, "device": "cuda"}]}, base)
    both = stage(versions=[{"version": "1", "handler": "models/stages.py:Echo", "path": "models/m.pt"}])
    assert "exactly one of path" in problems(config(both), base)


def test_roles_and_what_each_holds():
    assert roles_for(["cuda:0", "cpu"], 0) == ["models", "models+stages"]
    assert roles_for(["cuda:0"], 2) == ["models", "stages", "stages"]
    assert roles_for(["cpu"], 1) == ["models", "stages"]
    assert serves("models", "cpu", False, None) and not serves("stages", "cpu", False, None)
    assert serves("models", "cuda:0", True, "cuda") and not serves("models+stages", "cpu", True, "cuda")
    assert serves("stages", "cpu", True, "cpu") and serves("models+stages", "cpu", True, None)
    assert not serves("models", "cuda:0", True, "cpu") and not serves("models", "cpu", True, "cpu")


def test_stages_nobody_would_hold_are_start_up_errors(base):
    cfg = parse_config(config(stage(), stage("AddOne", device="cuda")), str(base))
    found = placement_problems(cfg.models, ["cpu"], roles_for(["cpu"], 0))
    assert found == ["stage 'addone' declares device: cuda, but no worker is on a GPU (workers.devices: ['cpu']): "
                     "give the workers a GPU, or set device: cpu on the stage"]
    found = placement_problems(cfg.models, ["cuda:0"], roles_for(["cuda:0"], 0))
    assert len(found) == 1 and "set workers.stage_workers: 1" in found[0] and "'echo'" in found[0]
    assert placement_problems(cfg.models, ["cuda:0", "cpu"], roles_for(["cuda:0"], 1)) == []


class FakeWorker:
    """What the handshake and placement read of a worker, and the methods that change it."""
    from tgw.broker.state.pool import WorkerHandle
    introduced, budgeted, loads_queued = WorkerHandle.introduced, WorkerHandle.budgeted, WorkerHandle.loads_queued

    def __init__(self, role: str, device: str = "cpu"):
        from tgw.broker.state.pool import Holding, WorkerState
        self.role, self.device, self.state, self.retiring = role, device, WorkerState.READY, False
        self.holding, self.models, self.name = Holding(), set(), f"w[{role}]"
        self.pid = self.device_uuid = self.device_memory = self.host_memory = self.budget = None
        self.under_way = {}


def test_each_worker_loads_what_its_role_holds(base):
    cfg = parse_config(config(stage(), stage("AddOne", device="cuda")), str(base))
    registry = Registry(cfg.models)
    hs = Handshake(registry)
    loads = {}
    for role, device in [("models", "cuda:0"), ("stages", "cpu"), ("models+stages", "cpu"), ("models", "cpu")]:
        msg = hs.hello(FakeWorker(role, device), WorkerHello(v=1, worker_id=0, pid=1), 0.0)
        loads[role, device] = sorted(s.name for s in msg.models)
    assert loads == {("models", "cuda:0"): ["addone", "m"], ("stages", "cpu"): ["echo"],
                     ("models+stages", "cpu"): ["echo", "m"], ("models", "cpu"): ["m"]}
    placement = Placement(registry, [], lambda ident, msg: None)
    assert placement.desired(FakeWorker("stages")) == {"echo:1"}
    assert placement.desired(FakeWorker("models", "cuda:0")) == {"m:1", "addone:1"}
