"""Triton model repositories read as tgw entries (broker/triton_repo/, config/repository.py):
each platform, the fields mapped, warned and refused, version_policy, ensembles as pipelines,
the merge into a config and `models convert`. Model files are stand-ins: a zip laid out as
torch.jit.save's (the broker tells the format from the zip's directory), a model.py text."""
from __future__ import annotations

import io
import os
import shutil
import zipfile
from contextlib import redirect_stdout

import pytest
import yaml

from tgw.broker.config.load import ConfigError, parse_config
from tgw.broker.triton_repo import config_from_json, parse_pbtxt, translate_model, translate_repository

PY_MODEL = "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n"

ADD = """
platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__1" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] format: FORMAT_NCHW } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2, 2 ] reshape: { shape: [ 4 ] }
           label_filename: "labels.txt" } ]
dynamic_batching { max_queue_delay_microseconds: 500 preferred_batch_size: [ 4, 8 ] priority_levels: 2
                   default_queue_policy { max_queue_size: 16 default_timeout_microseconds: 2500 } }
instance_group [ { count: 2 kind: KIND_CPU } ]
version_policy: { all { } }
parameters { key: "DISABLE_OPTIMIZED_EXECUTION" value: { string_value: "true" } }
optimization { execution_accelerators { cpu_execution_accelerator [ { name: "openvino" } ] } }
model_warmup [ { name: "w" batch_size: 4 inputs { key: "INPUT__0" value: { data_type: TYPE_FP32 dims: [ 4 ]
                 zero_data: true } } } ]
response_cache { enable: true }
"""
PRE = """
name: "pre"
backend: "python"
max_batch_size: 0
input [ { name: "RAW" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 4 ] } ]
parameters { key: "scale" value: { string_value: "2" } }
instance_group [ { kind: KIND_GPU } ]
"""
DETECT = """
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP16 dims: [ 3 ] optional: true } ]
output [ { name: "y" data_type: TYPE_BF16 dims: [ 3 ] } ]
"""
ENS = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "RAW" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "add" model_version: 2 input_map { key: "INPUT__0" value: "a" } input_map { key: "INPUT__1" value: "b" }
    output_map { key: "OUTPUT__0" value: "SUM" } },
  { model_name: "pre" model_version: -1 input_map { key: "RAW" value: "RAW" }
    output_map { key: "A" value: "a" } output_map { key: "B" value: "b" } } ] }
"""


def torchscript_standin() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("m/code/__torch__.py", "")
        z.writestr("m/data.pkl", b"")
    return buf.getvalue()


def write_model(root, name: str, pbtxt: str | None, files: dict[str, bytes | str]) -> str:
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    if pbtxt is not None:
        with open(os.path.join(d, "config.pbtxt"), "w") as f:
            f.write(pbtxt)
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
        with open(os.path.join(d, rel), "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
    return d


@pytest.fixture
def repo(tmp_path):
    root = str(tmp_path / "repo")
    ts = torchscript_standin()
    write_model(root, "add", ADD, {"1/model.pt": ts, "2/model.pt": ts, "labels.txt": "a\nb\nc\nd\n"})
    write_model(root, "pre", PRE, {"1/model.py": PY_MODEL, "3/model.py": PY_MODEL})
    write_model(root, "detect", DETECT, {"1/model.onnx": b"stand-in", "2/model.onnx": b"stand-in"})
    write_model(root, "ens", ENS, {"1/.keep": ""})
    return root


def test_each_platform_becomes_a_model_stage_or_pipeline(repo):
    t = translate_repository(repo)
    assert t.refusals == []
    models = {m["name"]: m for m in t.models}
    assert sorted(models) == ["add", "detect", "pre"]
    add = models["add"]
    # the PyTorch backend binds INPUT__N to the forward's N-th argument: declared in that order
    assert [i["name"] for i in add["inputs"]] == ["INPUT__0", "INPUT__1"]
    assert add["inputs"][0]["format"] == "FORMAT_NCHW" and "format" not in add["inputs"][1]
    assert add["outputs"] == [{"name": "OUTPUT__0", "dtype": "float32", "shape": [2, 2], "reshape": [4],
                               "labels": os.path.join(repo, "add", "labels.txt")}]
    assert add["versions"] == [{"version": v, "path": os.path.join(repo, "add", v, "model.pt"), "format": "torchscript"}
                               for v in ("1", "2")] and add["default_version"] == "2"
    assert (add["max_batch_size"], add["max_delay_us"], add["preferred_batch_sizes"], add["max_queue"],
            add["timeout_ms"], add["priority_levels"], add["warmup_batch_sizes"]) == (8, 500, [4, 8], 16, 3, 3, [4])
    assert add["cache"] == {"entries": 1024, "max_bytes": 64 << 20}
    pre = models["pre"]   # python backend: a stage of the latest version (default policy), config in its options
    assert pre["versions"] == [{"version": "3", "handler": os.path.join(repo, "pre", "3", "model.py") +
                                ":TritonPythonModel"}]
    assert pre["max_batch_size"] == 0 and pre["device"] == "cuda" and pre["inputs"][0]["dtype"] == "bytes"
    assert pre["options"]["scale"] == "2"
    assert config_from_json(pre["options"]["triton_model_config"]) == parse_pbtxt(PRE)
    detect = models["detect"]
    assert detect["versions"] == [{"version": "2", "path": os.path.join(repo, "detect", "2", "model.onnx"),
                                   "format": "onnx"}]
    assert [detect["inputs"][0]["dtype"], detect["outputs"][0]["dtype"]] == ["float16", "bfloat16"]
    # the ensemble: steps ordered by what they read, tensors renamed to <step>.<output>
    assert t.pipelines == [{"name": "ens", "version": "1", "inputs": ["RAW"], "steps": [
        {"name": "pre", "model": "pre", "inputs": {"RAW": "RAW"}},
        {"name": "add", "model": "add", "inputs": {"INPUT__0": "pre.A", "INPUT__1": "pre.B"}, "version": "2"}],
        "outputs": {"SUM": "add.OUTPUT__0"}}]
    warnings = {w.split(":")[0]: w for w in t.warnings}
    assert sorted(warnings) == ["model add", "model detect"]   # one line per model, each field named
    for field in ("optimization (", "parameters DISABLE_OPTIMIZED_EXECUTION (", "instance_group: kind (",
                  "instance_group: count (", "response_cache ("):
        assert field in warnings["model add"], field
    assert "input x: optional" in warnings["model detect"]


@pytest.mark.parametrize("text, refusal", [
    ('platform: "tensorrt_plan"', "platform: tensorrt_plan: tgw serves pytorch_libtorch"),
    ('backend: "python"\nmodel_transaction_policy { decoupled: true }', "decoupled: a decoupled model answers many "
     "times per request: write it as a tgw generator"),
    ('backend: "python"\ninput [ { name: "S" data_type: TYPE_INT64 dims: [ 1 ] is_shape_tensor: true } ]',
     "input S: is_shape_tensor: shape tensors are TensorRT's"),
    ('backend: "python"\ninput [ { name: "R" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]',
     "input R: allow_ragged_batch"),
    ('name: "other"\nbackend: "python"', "name: 'other' is not the folder's name 'm'"),
    ('backend: "python"\nversion_policy { specific { versions: [ 1, 7 ] } }',
     "version_policy: specific: versions [7] have no folder"),
    ('backend: "python"\nbatch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "n" data_type: TYPE_INT32 } ]',
     "batch_input/batch_output"),
    ('backend: "python"\noutput [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] label_filename: "none.txt" } ]',
     "output y: label_filename:"),
    ('platform: "ensemble"\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
     'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]\nensemble_scheduling { step [ { model_name: "a" '
     'input_map { key: "i" value: "t2" } output_map { key: "o" value: "t1" } }, { model_name: "b" input_map { key: '
     '"i" value: "t1" } output_map { key: "o" value: "t2" } } ] }', "(or the steps form a cycle)"),
    ('backend: "python"\nmax_batch_size: 4\nsequence_batching { }', "sequence_batching: a python-backend model"),
])
def test_what_would_change_answers_is_refused_naming_the_field(tmp_path, text, refusal):
    d = write_model(str(tmp_path), "m", None, {"1/model.py": PY_MODEL})
    t = translate_model(parse_pbtxt(text + '\ninput [ { name: "a" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                                    'output [ { name: "b" data_type: TYPE_FP32 dims: [ 1 ] } ]'), d)
    assert any(r.startswith("model m: ") and refusal in r for r in t.refusals), t.refusals
    assert t.models == [] and t.pipelines == []


def test_missing_files_and_bad_text_are_named(tmp_path):
    root = str(tmp_path)
    write_model(root, "noconfig", None, {"1/model.pt": torchscript_standin()})
    write_model(root, "nofile", 'platform: "pytorch_libtorch"\ninput [ { name: "a" data_type: TYPE_FP32 dims: [1] } ]'
                '\noutput [ { name: "b" data_type: TYPE_FP32 dims: [1] } ]', {"1/other.pt": b""})
    write_model(root, "badtext", 'platform: "pytorch_libtorch"\nmax_batch_size: "eight"', {})
    write_model(root, "noversion", 'backend: "python"\ninput [ { name: "a" data_type: TYPE_FP32 dims: [1] } ]'
                '\noutput [ { name: "b" data_type: TYPE_FP32 dims: [1] } ]', {"01/model.py": PY_MODEL})
    refusals = "\n".join(translate_repository(root).refusals)
    assert f"model noconfig: {root}/noconfig/config.pbtxt not found: tgw does not auto-complete" in refusals
    assert f"model nofile: version 1: {root}/nofile/1/model.pt not found" in refusals
    assert f"model badtext: {root}/badtext/config.pbtxt: not a valid model config: 2:" in refusals
    assert f"model noversion: version_policy: no numbered version folder in {root}/noversion" in refusals
    assert translate_repository(str(tmp_path / "absent")).refusals[0].endswith("cannot be read: No such file or directory")


def test_version_policy_picks_the_folders(tmp_path):
    d = write_model(str(tmp_path), "m", None, {f"{v}/model.py": PY_MODEL for v in (1, 2, 10)})
    base = 'backend: "python"\ninput [ { name: "a" data_type: TYPE_FP32 dims: [1] } ]\n' \
           'output [ { name: "b" data_type: TYPE_FP32 dims: [1] } ]\n'
    picked = {policy: [v["version"] for v in translate_model(parse_pbtxt(base + policy), d).models[0]["versions"]]
              for policy in ("", "version_policy { latest { num_versions: 2 } }", "version_policy { all { } }",
                             "version_policy { specific { versions: [ 1, 10 ] } }")}
    assert list(picked.values()) == [["10"], ["2", "10"], ["1", "2", "10"], ["1", "10"]]
    assert translate_model(parse_pbtxt(base), d, versions=["1"]).models[0]["versions"][0]["version"] == "1"


def test_sequence_batching_maps_to_tgw_controls_and_state(tmp_path):
    d = write_model(str(tmp_path), "acc", None, {"1/model.pt": torchscript_standin()})
    t = translate_model(parse_pbtxt("""
        platform: "pytorch_libtorch"
        max_batch_size: 4
        input [ { name: "INPUT__2" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 1 ] } ]
        sequence_batching {
          max_sequence_idle_microseconds: 5000000
          control_input [ { name: "START__1" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
                          { name: "CORRID__4" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] } ]
          state [ { input_name: "STATE__3" output_name: "STATE_OUT__1" data_type: TYPE_FP32 dims: [ 1 ]
                    initial_state { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true name: "z" } } ]
          direct { }
        }"""), d)
    assert t.refusals == []   # INPUT__N counted with the controls and states: the worker orders them all
    assert [i["name"] for i in t.models[0]["inputs"]] == ["INPUT__2", "INPUT__0"]
    assert t.models[0]["sequence_batching"] == {
        "max_sequences": 4, "max_sequence_idle_us": 5_000_000,
        "control_inputs": [{"name": "START__1", "kind": "start", "dtype": "float32"},
                           {"name": "CORRID__4", "kind": "corrid", "dtype": "uint64"}],
        "state": [{"name": "STATE__3", "output": "STATE_OUT__1", "dtype": "float32", "shape": [1]}]}
    assert "sequence_batching: direct" in t.warnings[0]


def test_config_merges_the_repository_and_refuses_a_clash(repo, tmp_path):
    shutil.rmtree(os.path.join(repo, "detect"))   # its stand-in file is no ONNX model; the rest are checked
    own = {"name": "mine", "versions": [{"version": "1", "handler": "tgw.workers.demo_models:Nothing"}],
           "inputs": [{"name": "x", "dtype": "float32", "shape": [1]}],
           "outputs": [{"name": "y", "dtype": "float32", "shape": [1]}]}
    cfg = parse_config({"model_repository": "repo", "models": [own]}, str(tmp_path))
    assert [m.name for m in cfg.models] == ["mine", "add", "pre"] and [p.name for p in cfg.pipelines] == ["ens"]
    assert cfg.model_roots == [str(tmp_path), os.path.realpath(repo)]
    assert cfg.model("add").versions[1].format == "torchscript" and len(cfg._repository_warnings) == 1
    with pytest.raises(ConfigError) as err:
        parse_config({"model_repository": "repo", "models": [{**own, "name": "add"}]}, str(tmp_path))
    assert "model_repository: model add of" in str(err.value) and "has the name of models.0" in str(err.value)
    # a translated model the schema rejects is named by its folder, not by a key path never written
    write_model(repo, "strs", 'platform: "pytorch_libtorch"\ninput [ { name: "s" data_type: TYPE_STRING dims: [1] } ]'
                '\noutput [ { name: "b" data_type: TYPE_FP32 dims: [1] } ]', {"1/model.pt": torchscript_standin()})
    with pytest.raises(ConfigError) as err:
        parse_config({"model_repository": repo}, repo)
    assert f"model_repository: model strs ({repo}/strs/config.pbtxt): " in str(err.value)
    assert "only stages (versions with a handler) take or return bytes" in str(err.value)


def test_convert_prints_yaml_that_loads_as_a_config(repo):
    shutil.rmtree(os.path.join(repo, "detect"))
    from tgw.broker.cli.main import run
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as code:
        run(["models", "convert", repo])
    assert code.value.code == 0
    text = out.getvalue()
    assert text.startswith(f"# tgw config of the Triton model repository {os.path.realpath(repo)}")
    assert "# warning: model add: not honoured: " in text
    cfg = parse_config(yaml.safe_load(text), "/")
    assert [m.name for m in cfg.models] == ["add", "pre"] and cfg.pipelines[0].name == "ens"


def test_an_ensemble_of_ensembles_is_refused_by_name(repo):
    write_model(repo, "outer", ENS.replace('model_name: "pre"', 'model_name: "ens"'), {"1/.keep": ""})
    t = translate_repository(repo)
    assert [p["name"] for p in t.pipelines] == ["ens"]
    assert t.refusals == ["model outer: ensemble_scheduling: steps on ensembles ['ens']: a pipeline's step is a "
                          "model or a stage; list the inner ensemble's steps in this one"]


def test_check_config_reads_a_repository_alone(repo):
    shutil.rmtree(os.path.join(repo, "detect"))
    from tgw.broker.cli.main import run
    out = io.StringIO()
    with redirect_stdout(out):
        run(["check-config", "--model-repository", repo])
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("warning: model add: not honoured: optimization (")
    assert lines[1] == f"{repo}: OK (2 model(s): add, pre)" and "pipeline ens (version 1): pre (pre) -> add (add" \
        in out.getvalue()
    with pytest.raises(SystemExit) as err:
        run(["check-config"])
    assert err.value.code == "tgw-broker check-config: name a config FILE, --model-repository DIR, or both"


def test_two_repositories_merge_and_a_name_in_both_is_refused(repo, tmp_path):
    shutil.rmtree(os.path.join(repo, "detect"))
    other = str(tmp_path / "other")
    write_model(other, "solo", PRE.replace('name: "pre"', ""), {"1/model.py": PY_MODEL})
    from tgw.broker.config.load import repository_config
    cfg = repository_config([repo, other])
    assert [m.name for m in cfg.models] == ["add", "pre", "solo"] and cfg._repository_flag == [repo, other]
    assert cfg.model_roots == [os.path.realpath(repo), os.path.realpath(other)]
    write_model(other, "pre", PRE, {"1/model.py": PY_MODEL})
    with pytest.raises(ConfigError) as err:
        repository_config([repo, other])
    assert f"model_repository: model pre of {os.path.realpath(other)} has the name of model pre of " \
        f"{os.path.realpath(repo)}: a served name is declared once" in str(err.value)


def test_torchscript_inputs_named_otherwise_keep_the_file_order_and_say_so(tmp_path):
    d = write_model(str(tmp_path), "m", None, {"1/model.pt": torchscript_standin()})
    t = translate_model(parse_pbtxt('platform: "pytorch_libtorch"\ninput [ { name: "b" data_type: TYPE_FP32 dims: [1] },'
                                    ' { name: "a" data_type: TYPE_FP32 dims: [1] } ]\n'
                                    'output [ { name: "y" data_type: TYPE_FP32 dims: [1] } ]'), d)
    assert [i["name"] for i in t.models[0]["inputs"]] == ["b", "a"]
    assert t.warnings == ["model m: not honoured: input names (not all NAME__N: passed to forward in config.pbtxt's "
                          "order, not matched to its argument names (list them in forward's order))"]


def test_bad_config_text_and_json_are_value_errors():
    with pytest.raises(ValueError, match=r"^not a valid model config: 1:\d+ : .*max_batch"):
        parse_pbtxt('max_batch_size: "x"')
    with pytest.raises(ValueError, match="^not a valid model config: .*no field named \"maxbatch\""):
        config_from_json('{"maxbatch": 1}')
    with pytest.raises(ValueError, match="^not a valid model config: Expecting property name"):
        config_from_json("{")
    assert config_from_json({"name": "m", "max_batch_size": 2}).max_batch_size == 2
