"""Pipeline declarations (broker/config/pipelines.py): every refusal names its key path, and the
pipeline's inputs and outputs are derived from the steps' models. (`tgw-broker check-config` printing
them: tests/process/test_check_config.py.)"""
from __future__ import annotations

import copy

import pytest

from conftest import unloaded_model
from pipeline_cases import model, valid
from tgw.broker.config import ConfigError, parse_config
from tgw.broker.config.pipelines import derive
from tgw.shm.wire import IOSpec


@pytest.fixture
def base(tmp_path):
    base = tmp_path.resolve()
    for name in ("dec", "net", "top", "join", "pair", "other"):
        unloaded_model(base / f"{name}.pt", name.encode())
    return base


def refused(data, base) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, str(base))
    return str(info.value)


def test_a_valid_pipeline_loads_and_its_io_is_derived_from_the_steps(base):
    cfg = parse_config(valid(), str(base))
    p = cfg.pipelines[0]
    assert (p.name, p.version, p.timeout_ms, [s.name for s in p.steps]) == ("classify", "3", 500,
                                                                              ["decode", "infer", "top5"])
    d = derive(p, {m.name: m for m in cfg.models})
    assert d.inputs == [IOSpec(name="image", dtype="uint8", shape=[-1, 3])]
    assert d.outputs == [IOSpec(name="labels", dtype="int64", shape=[5]),
                         IOSpec(name="scores", dtype="float32", shape=[5])]
    assert d.max_batch_size == 8   # the smallest of its steps'


def test_a_diamond_and_an_input_feeding_two_steps_derive_the_more_specific_shape(base):
    data = valid()
    data["models"].append(model("pair", [("u", "uint8", [4, -1]), ("v", "uint8", [-1, 3])], [("w", "float32", [10])]))
    data["pipelines"] = [{"name": "both", "inputs": ["image"],
                          "steps": [{"name": "p", "model": "pair", "inputs": {"u": "image", "v": "image"}},
                                    {"name": "decode", "model": "dec", "inputs": {"image": "image"}},
                                    {"name": "n", "model": "net", "inputs": {"x": "decode.pixels"}},
                                    {"name": "j", "model": "join", "inputs": {"a": "p.w", "b": "n.emb"}}],
                          "outputs": {"y": "j.y", "logits": "n.logits"}}]
    cfg = parse_config(data, str(base))
    d = derive(cfg.pipelines[0], {m.name: m for m in cfg.models})
    assert d.inputs == [IOSpec(name="image", dtype="uint8", shape=[4, 3])]
    assert [o.name for o in d.outputs] == ["y", "logits"] and cfg.pipelines[0].version == "1"


def test_no_pipelines_is_the_default(base):
    data = valid()
    del data["pipelines"]
    assert parse_config(data, str(base)).pipelines == []


def mutate(change) -> dict:
    data = copy.deepcopy(valid())
    change(data["pipelines"][0], data)
    return data


def steps(p):
    return p["steps"]


CASES = [
    ("name of a model", lambda p, d: p.update(name="net"),
     "pipelines.0.name: pipeline 'net' has the name of a model"),
    ("duplicate pipeline", lambda p, d: d["pipelines"].append(copy.deepcopy(p)),
     "pipelines.1.name: duplicate pipeline name 'classify' (also at pipelines.0)"),
    ("duplicate step", lambda p, d: steps(p)[2].update(name="infer"),
     "pipelines.0.steps.2.name: duplicate step name 'infer'"),
    ("unknown model", lambda p, d: steps(p)[1].update(model="nope"),
     "pipelines.0.steps.1.model: no model named 'nope'"),
    ("unknown pinned version", lambda p, d: steps(p)[1].update(version="9"),
     "pipelines.0.steps.1.version: model 'net' has no version '9' (versions: 1)"),
    ("unmapped input", lambda p, d: steps(p)[1].update(inputs={}),
     "pipelines.0.steps.1.inputs: model 'net' input(s) ['x'] are not mapped"),
    ("not an input of the model", lambda p, d: steps(p)[1]["inputs"].update(z="decode.pixels"),
     "pipelines.0.steps.1.inputs.z: model 'net' has no input 'z' (inputs: x)"),
    ("unknown source", lambda p, d: steps(p)[1]["inputs"].update(x="pixels"),
     "pipelines.0.steps.1.inputs.x: 'pixels' is neither a pipeline input (image) nor"),
    ("forward reference", lambda p, d: steps(p)[1]["inputs"].update(x="top5.scores"),
     "pipelines.0.steps.1.inputs.x: 'top5.scores' names no earlier step"),
    ("self reference", lambda p, d: steps(p)[2]["inputs"].update(logits="top5.scores"),
     "pipelines.0.steps.2.inputs.logits: 'top5.scores' names itself"),
    ("no such output", lambda p, d: steps(p)[2]["inputs"].update(logits="infer.probs"),
     "pipelines.0.steps.2.inputs.logits: step 'infer' (model 'net') has no output 'probs' (outputs: logits, emb)"),
    ("dtype mismatch", lambda p, d: d["models"][1]["inputs"][0].update(dtype="float16"),
     "pipelines.0.steps.1.inputs.x: dtype mismatch: decode.pixels is float32, model 'net' input 'x' takes float16"),
    ("shape mismatch", lambda p, d: d["models"][1]["inputs"][0].update(shape=[3, 9]),
     "pipelines.0.steps.1.inputs.x: shape mismatch: decode.pixels is [3, 8], model 'net' input 'x' takes [3, 9]"),
    ("unused input", lambda p, d: p.update(inputs=["image", "extra"]),
     "pipelines.0.inputs: pipeline inputs ['extra'] feed no step"),
    ("duplicate input", lambda p, d: p.update(inputs=["image", "image"]),
     "pipelines.0.inputs: duplicate pipeline inputs ['image']"),
    ("output of no step", lambda p, d: p["outputs"].update(labels="top9.labels"),
     "pipelines.0.outputs.labels: 'top9.labels' is not \"<step>.<output>\" of a step of this pipeline"),
    ("output not a step's", lambda p, d: p["outputs"].update(labels="image"),
     "pipelines.0.outputs.labels: 'image' is not \"<step>.<output>\""),
    ("unknown output of a step", lambda p, d: p["outputs"].update(labels="top5.names"),
     "pipelines.0.outputs.labels: step 'top5' (model 'top') has no output 'names'"),
    ("dot in a step name", lambda p, d: steps(p)[0].update(name="de.code"),
     "pipelines.0.steps.0.name: String should match pattern"),
    ("unknown key", lambda p, d: p.update(stepz=[]), "pipelines.0.stepz: unknown key"),
    ("no steps", lambda p, d: p.update(steps=[]), "pipelines.0.steps: List should have at least 1 item"),
]


@pytest.mark.parametrize("change, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_refusal_names_its_key_path(base, change, expected):
    assert expected in refused(mutate(change), base)


def test_a_pipeline_input_feeding_two_steps_must_agree(base):
    def change(p, d):
        d["models"].append(model("other", [("image", "uint8", [-1, 4])], [("o", "float32", [1])]))
        steps(p).append({"name": "side", "model": "other", "inputs": {"image": "image"}})
    text = refused(mutate(change), base)
    assert ("pipelines.0.steps.3.inputs.image: pipeline input 'image' feeds uint8 [-1, 4] here but uint8 [-1, 3] "
            "at pipelines.0.steps.0.inputs.image") in text


def test_every_problem_is_reported_at_once_on_its_own_line(base):
    def change(p, d):
        steps(p)[1].update(model="nope")
        p["outputs"].update(labels="top5.names")
    lines = refused(mutate(change), base).splitlines()
    assert lines[0].endswith("2 problem(s)")
    assert lines[1].startswith("  pipelines.0.steps.1.model:") and lines[2].startswith("  pipelines.0.outputs.labels:")
