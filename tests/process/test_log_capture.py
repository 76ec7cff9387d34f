"""Logs that parse, and failures said once (issue 39): with `--log-format json` every line the
broker and its workers write is one JSON record - a handler's print(), its Python warning, a
line written straight to fd 2 as torch's C++ warnings are; a failed load answers with a few
lines (what, cause, fix) and its traceback is logged once; start and stop log one line each.
In text mode a worker's lines carry time, level and process. check-config names the module a
torch.export file needs preloaded."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from conftest import base_config, wait_until

from tgw.broker.cli.ask import ask
from tgw.broker.config.load import ConfigError, parse_config
from tgw.client import Client, TgwError
from tgw.shm.wire import PROTOCOL_VERSION, LoadVersion

TYPES_MODULE = "tgw_test_outputs"   # a module no worker imports: its type is registered only there
NOISY = textwrap.dedent('''\
    import os, sys, warnings
    from tgw.workers.stage import Stage
    print("noisy: print at import")
    warnings.warn("noisy: a warning at import")
    os.write(2, b"[W1206 04:12:50.123456 4242 noisy.cpp:12] noisy: a C++ warning on fd 2\\n")

    class Noisy(Stage):
        def __call__(self, batch):
            print("noisy: print in a call")
            sys.stderr.write("noisy: to sys.stderr")   # no newline: flushed at exit all the same
            return {"y": batch["x"] + 1}
    ''')


@pytest.fixture(scope="module")
def needs_module(tmp_path_factory) -> str:
    """A torch.export file whose output type is registered by TYPES_MODULE (as Hugging Face's
    outputs are by transformers.modeling_outputs): made here, where the module is imported."""
    d = tmp_path_factory.mktemp("pt2")
    (d / f"{TYPES_MODULE}.py").write_text(textwrap.dedent(f'''\
        import dataclasses, torch
        import torch.utils._pytree as pytree

        @dataclasses.dataclass
        class Out:
            y: torch.Tensor

        pytree.register_dataclass(Out, serialized_type_name="{TYPES_MODULE}.Out")
        '''))
    sys.path.insert(0, str(d))
    try:
        types = __import__(TYPES_MODULE)
    finally:
        sys.path.remove(str(d))

    class Model(torch.nn.Module):
        def forward(self, x):
            return types.Out(x * 2)
    path = str(d / "needs_module.pt2")
    torch.export.save(torch.export.export(Model(), (torch.zeros(2, 256),)), path)
    return path


def records(b) -> list[dict]:
    """Every line of the broker's output (stdout and stderr, the workers' too) as JSON."""
    out = []
    for line in b.output().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
    return out


def test_json_mode_every_line_is_a_record(make_broker, model_files, short_dir, needs_module):
    with open(os.path.join(short_dir, "noisy.py"), "w") as f:
        f.write(NOISY)
    cfg = base_config(model_files, "mlp")
    cfg["workers"]["stage_workers"] = 1
    cfg["models"].append({"name": "noisy", "versions": [{"version": "1", "handler": "noisy.py:Noisy"}],
                          "inputs": [{"name": "x", "dtype": "float32", "shape": [4]}],
                          "outputs": [{"name": "y", "dtype": "float32", "shape": [4]}]})
    b = make_broker(cfg, start=False).start(args=("--log-format", "json"))
    with Client(b.address) as c:
        assert c.infer("noisy", {"x": np.zeros((1, 4), np.float32)})["y"].tolist() == [[1.0] * 4]

    # a load that fails: a few lines to the caller, naming the module to preload
    with pytest.raises(TgwError) as failed:
        ask(b.address, LoadVersion(v=PROTOCOL_VERSION, model="mlp", version="2", path=needs_module), 60)
    said = failed.value.message
    assert f"workers.preload: [{TYPES_MODULE}]" in said and "Traceback" not in said, said
    assert len(said.splitlines()) <= 4, said

    assert b.stop() == 0
    recs = records(b)   # every line parses, to the last one
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in recs)

    def find(**want) -> list[dict]:
        return [r for r in recs if all(r.get(k) == v for k, v in want.items())]
    assert find(logger="stdout", level="INFO", msg="noisy: print at import")
    assert find(logger="stdout", msg="noisy: print in a call")[0]["process"].startswith("worker")
    assert find(logger="stderr", level="WARNING", msg="noisy: to sys.stderr")
    assert [r for r in recs if r["logger"] == "torch" and "noisy: a C++ warning on fd 2" in r["msg"]]
    assert [r for r in recs if r["logger"] == "py.warnings" and "noisy: a warning at import" in r["msg"]]
    # the traceback once (the worker's line); the broker's line has the short text only
    traced = find(event="model_load_traceback")
    assert len(traced) == 1 and "Traceback" in traced[0]["exc"], traced
    assert sum("Traceback" in r.get("exc", "") for r in recs if r["logger"].startswith("tgw")) == 1
    broker_line = find(event="model_load_failed")[0]
    assert "Traceback" not in broker_line["msg"] and "\n" not in broker_line["msg"]
    assert TYPES_MODULE in broker_line["error"]
    # one line at the start and one at the stop, with what they did
    start, stop = find(event="start")[0], find(event="stop")[0]
    assert start["workers"] == 2 and start["models"] == ["mlp", "noisy"] and start["start_s"] > 0
    assert re.search(r"2 model\(s\), 2 version\(s\) loaded on 2 worker\(s\), started in [\d.]+ s", start["msg"])
    assert (stop["signal"], stop["answered"], stop["cut_short"]) == ("SIGTERM", 1, 0), stop
    assert stop["msg"].startswith("stopped on SIGTERM after ")


def test_worker_text_lines_carry_time_level_and_process():
    """A worker's logging set up as its start sets it, in a process of its own: each line of what
    it logs, prints or writes to fd 2 has time, level and worker<id>[pid]."""
    code = ("import os, logging; from tgw.workers.tracing import setup_logging; setup_logging('text', 3); "
            "logging.getLogger('tgw.worker').info('a record'); print('a print'); "
            "os.write(2, b'raw on fd 2\\n'); print('last words', end='')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "", r
    lines = r.stderr.splitlines()
    line = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING) worker3\[\d+\] ([\w.]+): (.*)$")
    parsed = [line.match(x) for x in lines]
    assert all(parsed), lines
    assert sorted((m[2], m[3]) for m in parsed) == [("stderr", "raw on fd 2"), ("stdout", "a print"),
                                                    ("stdout", "last words"), ("tgw.worker", "a record")]


def test_check_config_names_the_module_to_preload(tmp_path, needs_module):
    data = {"model_roots": ["/"], "workers": {"devices": ["cpu"]},
            "models": [{"name": "m", "versions": [{"version": "1", "path": needs_module}],
                        "inputs": [{"name": "x", "dtype": "float32", "shape": [256]}],
                        "outputs": [{"name": "y", "dtype": "float32", "shape": [256]}]}]}
    with pytest.raises(ConfigError) as refused:
        parse_config(data, str(tmp_path))
    assert f"models.0.versions.0.path: {needs_module} needs the types of module {TYPES_MODULE}" in str(refused.value)
    assert f"workers.preload: [{TYPES_MODULE}]" in str(refused.value)
    data["workers"]["preload"] = [TYPES_MODULE]
    parse_config(data, str(tmp_path))
    data["workers"]["preload"] = [f"/opt/somewhere/{TYPES_MODULE}.py"]   # a file by path names its module
    parse_config(data, str(tmp_path))
