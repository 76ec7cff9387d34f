"""`tgw-broker check-config` run as operators run it, in its own process: it says OK and what it
resolved (models, arena sizes, each pipeline with its steps and io), or exits non-zero naming the
key path, never with a traceback. Its parsing is unit-tested in tests/unit/test_config*.py,
test_arenas.py and test_pipeline_config.py; bad flags: tests/process/test_cli_errors.py."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import yaml

from config_cases import make_model_dir, valid, write
from conftest import placeholder_model, readme_block, unloaded_model
from pipeline_cases import valid as valid_pipelines


def check_config(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tgw.broker", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60)


# ---- a valid config, a refused one, a missing one (tests/unit/test_config_files.py) ------------

def test_cli_check_config(tmp_path):
    model_dir = make_model_dir(tmp_path)
    good = write(model_dir, yaml.safe_dump(valid()))
    r = check_config(good)
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout and "a, b" in r.stdout

    data = copy.deepcopy(valid())
    data["models"][0]["batching"] = {}
    data["models"][1]["versions"][0]["path"] = "models/nope.pt"
    bad = model_dir / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    r = check_config(str(bad))
    assert r.returncode != 0
    assert "models.0.batching" in r.stderr and "unknown key" in r.stderr
    assert "Traceback" not in r.stderr

    r = check_config(str(model_dir / "missing.yaml"))
    assert r.returncode != 0 and "cannot read config" in r.stderr and "Traceback" not in r.stderr


# ---- the arena sizes (tests/unit/test_arenas.py) -------------------------------------------------

def test_check_config_prints_the_resolved_sizes(tmp_path):
    resnet = {"name": "resnet", "versions": [{"version": "1", "path": placeholder_model()}], "max_batch_size": 32,
              "inputs": [{"name": "i0", "dtype": "float32", "shape": [3, 64, 64]}],
              "outputs": [{"name": "o0", "dtype": "float32", "shape": [1000]}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"workers": {"devices": ["cpu"], "output_arena_mb": 2}, "models": [resnet],
                                    "model_roots": [os.path.dirname(placeholder_model())]}))
    r = check_config(path)
    assert r.returncode == 0, r.stderr
    assert "input arena 5 MiB (workers.input_arena_mb: auto)" in r.stdout, r.stdout
    assert "output arena 2 MiB (workers.output_arena_mb: 2)" in r.stdout, r.stdout


# ---- pipelines (tests/unit/test_pipeline_config.py) ----------------------------------------------

PIPELINES = valid_pipelines()   # three steps, and a model no pipeline uses


def test_check_config_prints_each_pipeline_with_its_steps_and_io(tmp_path):
    for model in PIPELINES["models"]:
        unloaded_model(tmp_path / f"{model['name']}.pt", model["name"].encode())
    path = tmp_path / "tgw.yaml"
    path.write_text(yaml.safe_dump(PIPELINES))
    out = check_config(path)
    assert out.returncode == 0, out.stderr
    assert "pipeline classify (version 3): decode (dec) -> infer (net:1) -> top5 (top)" in out.stdout
    assert "inputs: image uint8 [-1, 3]; outputs: labels int64 [5], scores float32 [5]" in out.stdout


def test_the_docs_example_passes_check_config(tmp_path):
    """docs/PIPELINES.md's config as printed, with its files made here (stubs: never loaded)."""
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "vision.py").write_text("class DecodeImage:\n    pass\n\n\nclass TopK:\n    pass\n")
    for i, name in enumerate(("resnet-v1.pt", "resnet-v2.pt")):
        unloaded_model(tmp_path / name, bytes([i]))
    path = tmp_path / "tgw.yaml"
    path.write_text(readme_block("pipeline-example:config"))
    out = check_config(path)
    assert out.returncode == 0, out.stderr
    assert "pipeline classify (version 1): decode (decode-image) -> infer (resnet:2) -> top5 (top5)" in out.stdout
    assert "inputs: image bytes []; outputs: labels bytes [5], scores float32 [5]" in out.stdout


# ---- check-config --load ------------------------------------------------------------------------

BROKEN_STAGE = """class Upper:
    def __init__(self):
        self.table = undefined_table   # NameError at load, in the handler's own code

    def __call__(self, batch):
        return batch
"""


def test_check_config_load_reports_each_version_as_a_load_would(tmp_path):
    """A model that loads, a file the config takes for TorchScript that no worker can load, and a
    stage whose constructor raises: one line each, exit 1, no traceback (no segment left: the
    leak guard of conftest.py)."""
    from tgw.testing.lifecycle import model_decl, save_add_model
    save_add_model(str(tmp_path / "add1.pt"), 1)
    unloaded_model(tmp_path / "junk.pt")
    (tmp_path / "upper.py").write_text(BROKEN_STAGE)
    stage = {"name": "upper", "versions": [{"version": "1", "handler": "upper.py:Upper"}],
             "inputs": [{"name": "text", "dtype": "bytes", "shape": []}],
             "outputs": [{"name": "text", "dtype": "bytes", "shape": []}], "max_batch_size": 4}
    config = tmp_path / "tgw.yaml"
    config.write_text(yaml.safe_dump({"model_roots": [str(tmp_path)], "workers": {"devices": ["cpu"]},
                                      "models": [model_decl("m", [("1", "add1.pt")]),
                                                 model_decl("junk", [("1", "junk.pt")]), stage]}))
    plain = check_config(config)
    assert plain.returncode == 0 and "loading" not in plain.stdout, plain.stderr   # without --load: nothing loads
    r = subprocess.run([sys.executable, "-m", "tgw.broker", "check-config", str(config), "--load"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    report = r.stdout[r.stdout.index("loading 3 version(s) on cpu"):].splitlines()[1:]
    assert report[0].startswith("  m:1: ok (load "), report
    assert report[1].startswith("  junk:1: FAILED: RuntimeError: "), report
    assert report[2].startswith("  upper:1: FAILED: ") and "undefined_table" in report[2], report
    assert "Traceback" not in r.stdout + r.stderr
