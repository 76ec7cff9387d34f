"""Stages served by a real broker (one for the module): a copy of tests/stages.py under
model_roots as the handler file, workers.stage_workers: 1 beside one CPU model worker, and a
TorchScript model. A stage by name with bytes in and out; a failed row answered alone while its
batch neighbours are served; options reaching setup; where each version runs; a stage that
ends its process (the poison rule); bad handlers refused by check-config with their key path."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import yaml

import stages
from conftest import in_parallel, model_entry, readme_block, wait_until
from tgw.testing.child import BrokerProc
from tgw.client import Client, TgwError
from tgw.shm.errors import Code

BATCHED = {"max_batch_size": 4, "max_delay_us": 5_000_000}   # held until 4 rows came: one batch


def stage_config(root: str, files: dict) -> dict:
    """The module's config: handlers from ROOT/stages/stages.py."""
    handler = "stages/stages.py"
    return {"model_roots": [root, os.path.dirname(files["mlp"][0])],
            "workers": {"devices": ["cpu"], "stage_workers": 1, "threads_per_worker": 1, "input_arena_mb": 4,
                        "output_arena_mb": 2},
            "models": [model_entry(files, "mlp"),
                       stages.stage_entry(handler, "Echo"),
                       stages.stage_entry(handler, "RowFails", **BATCHED),
                       stages.stage_entry(handler, "Crash", **BATCHED),
                       stages.stage_entry(handler, "Tagged", options={"tag": "-tagged"}, device="cpu"),
                       stages.stage_entry(handler, "Upper", residency="on_demand")]}


@pytest.fixture(scope="module")
def broker(model_files):
    d = tempfile.mkdtemp(prefix="tgws-", dir="/tmp")
    os.makedirs(os.path.join(d, "stages"))
    shutil.copy(stages.__file__, os.path.join(d, "stages", "stages.py"))
    cfg = stage_config(d, model_files)
    # docs/STAGES.md's example, as printed: its handler file and its config's entries
    with open(os.path.join(d, "stages", "text.py"), "w") as f:
        f.write(readme_block("stage-example:handler"))
    example = yaml.safe_load(readme_block("stage-example:config"))
    assert example["workers"] == {"stage_workers": cfg["workers"]["stage_workers"]}
    cfg["models"] += example["models"]
    b = BrokerProc(cfg, d).start()
    yield b
    code = b.stop()
    shutil.rmtree(d, ignore_errors=True)
    assert code == 0, f"broker exited {code} on SIGTERM:\n{b.output()}"


def texts(values) -> list[bytes]:
    return [bytes(v) for v in np.asarray(values, dtype=object).ravel()]




def test_a_stage_is_served_by_name_bytes_in_and_out(broker):
    with Client(broker.address) as c:
        out = c.infer("echo", {"data": [b"ab", b"", "h\u00e9"]})
        assert texts(out["data"]) == [b"ab", b"", "h\u00e9".encode()]
        assert out["length"].tolist() == [2, 0, 3]
        assert {m["name"] for m in c.models()} >= {"echo", "rowfails", "crash", "tagged", "mlp"}
        assert c.infer("mlp", {"x": np.ones((1, 256), np.float32)})   # the model beside them


def test_the_docs_example_stage_serves_as_printed(broker):
    with Client(broker.address) as c:
        out = c.infer("words", {"text": ["Hello big World again"]})
        assert texts(out["words"]) == [b"hello big world"] and out["count"].tolist() == [4]
        with pytest.raises(TgwError) as info:
            c.infer("words", {"text": [b"\xffnot text"]})
    assert info.value.code is Code.INVALID_ARGUMENT
    assert info.value.message == "stage words: not UTF-8 text: invalid start byte at byte 0"


def test_stages_run_on_the_stage_worker_and_the_model_on_the_model_worker(broker):
    with Client(broker.address) as c:
        workers = {w["role"]: w for w in c.status()["workers"]}
    assert set(workers) == {"models", "stages"}
    assert workers["models"]["models"] == ["mlp:1"]
    assert set(workers["stages"]["models"]) >= {"crash:1", "echo:1", "rowfails:1", "tagged:1", "words:1"}
    assert workers["stages"]["device"] == "cpu"


def test_an_on_demand_stage_loads_on_the_stage_worker_when_first_asked(broker):
    with Client(broker.address) as c:
        assert texts(c.infer("upper", {"data": [b"shout"]}, timeout=60)["data"]) == [b"SHOUT"]
        holders = [w["role"] for w in c.status()["workers"] if "upper:1" in w["models"]]
    assert holders == ["stages"]


def test_options_and_context_reach_setup(broker):
    with Client(broker.address) as c:
        out = c.infer("tagged", {"data": [b"x"]})
    assert texts(out["data"]) == [b"x-tagged"]
    assert texts(out["context"]) == [b"tagged|1|stages|cpu|1|warmed=True"]


def test_a_failed_row_fails_its_request_and_its_neighbours_are_served(broker):
    rows = [b"one", b"two", b"bad row", b"four"]
    out = in_parallel(broker.address, "rowfails", rows)
    for row, result in zip(rows, out):
        if row == b"bad row":
            assert isinstance(result, TgwError) and result.code is Code.INVALID_ARGUMENT, result
            # the stage numbers the batch's rows; the details, the request's own (its one row)
            assert re.fullmatch(r"stage rowfails: row [0-3] starts with 'bad': b'bad row'", result.message)
            assert result.details["row"] == 0, result.details
        else:
            assert not isinstance(result, TgwError) and texts(result["data"]) == [row], result
    with Client(broker.address) as c:
        counts = c.stats()["models"]["rowfails"]
    assert counts["batch_sizes"] == {"4": 1}, counts   # the four were one batch
    assert counts["replies"] == 3 and counts["errors"] == {"INVALID_ARGUMENT": 1}


def test_a_stage_that_kills_its_worker_is_the_poison_and_its_neighbours_are_served(model_files, make_broker,
                                                                                     short_dir):
    """A broker of its own: the stage worker's restarts are this test's children."""
    os.makedirs(os.path.join(short_dir, "stages"))
    shutil.copy(stages.__file__, os.path.join(short_dir, "stages", "stages.py"))
    cfg = stage_config(short_dir, model_files)
    cfg["models"] = [m for m in cfg["models"] if m["name"] in ("mlp", "crash")]
    broker = make_broker(cfg)
    with Client(broker.address) as c:
        before = {w["role"]: w for w in c.status()["workers"]}
    rows = [b"a", b"crash", b"b", b"c"]
    out = in_parallel(broker.address, "crash", rows)
    for row, result in zip(rows, out):
        if row == b"crash":
            assert isinstance(result, TgwError) and result.code is Code.WORKER_DIED, result
            assert result.details.get("poison") is True, result.details
        else:
            assert not isinstance(result, TgwError) and texts(result["data"]) == [row], result
    with Client(broker.address) as c:
        wait_until(lambda: all(w["state"] == "ready" for w in c.status()["workers"]), 60, "the stage worker back")
        after = {w["role"]: w for w in c.status()["workers"]}
        assert texts(c.infer("crash", {"data": [b"again"]})["data"]) == [b"again"]
    assert after["stages"]["restarts"] == before["stages"]["restarts"] + 2   # the batch, then the poison alone
    assert after["models"]["pid"] == before["models"]["pid"] and after["models"]["restarts"] == 0
    assert "two worker deaths" in broker.output() and "model=crash" in broker.output()


def check_config(folder, cfg: dict) -> subprocess.CompletedProcess:
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "tgw.broker", "check-config", str(path)], capture_output=True,
                          text=True, timeout=60)


def test_check_config_refuses_bad_handlers_by_key_path(tmp_path, model_files):
    root = tmp_path / "root"
    (root / "stages").mkdir(parents=True)
    shutil.copy(stages.__file__, root / "stages" / "stages.py")
    outside = tmp_path / "outside.py"
    shutil.copy(stages.__file__, outside)
    cfg = stage_config(str(root), model_files)
    cfg["models"][1]["versions"][0]["handler"] = f"{outside}:Echo"
    cfg["models"][2]["versions"][0]["handler"] = "stages/stages.py:NoSuchClass"
    done = check_config(root, cfg)
    assert done.returncode != 0, done.stdout
    text = done.stdout + done.stderr
    assert f"models.1.versions.0.handler: {outside} is outside model_roots" in text, text
    assert "models.2.versions.0.handler: handler file" in text and "defines no 'NoSuchClass'" in text, text
