"""The .mar reader and the model store (broker/torchserve/archive.py, store.py) on archives made
here: what a MANIFEST maps to (the stage declaration, batching from the registration or
model-config.yaml), each archive tgw cannot serve refused with the file and the reason, an unpack
done once, a url outside the store or with a scheme refused, and a start that would serve nothing."""
from __future__ import annotations

import json
import os
import tarfile
import zipfile

import pytest

from tgw.broker.config.load import ConfigError, parse_config
from tgw.broker.torchserve.archive import ENTRY_FILE, ArchiveError, Registration, model_decl, unpack
from tgw.broker.torchserve.store import ModelStore, with_store

pytestmark = pytest.mark.unit


def make_mar(path: str, model: dict | None = None, files: dict | None = None, runtime: str = "python",
             manifest: bytes | None = None) -> str:
    model = {"modelName": "m", "modelVersion": "1.0", "handler": "handler.py", "serializedFile": "model.pt",
             **(model or {})}
    files = {"handler.py": "def handle(data, context):\n    return data\n", "model.pt": "weights", **(files or {})}
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("MAR-INF/MANIFEST.json", manifest if manifest is not None else
                   json.dumps({"runtime": runtime, "model": model, "archiverVersion": "0.12.0"}))
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_an_archive_is_a_stage_batched_as_registered(tmp_path):
    mar = make_mar(str(tmp_path / "m.mar"), {"configFile": "model-config.yaml", "requirementsFile": "req.txt"},
                   {"model-config.yaml": "batchSize: 8\nmaxBatchDelay: 20\nresponseTimeout: 5\n", "req.txt": "x\n"})
    archive = unpack(mar, str(tmp_path / "u"))
    assert (archive.name, archive.version, archive.handler) == ("m", "1.0", "handler.py")
    assert os.path.exists(os.path.join(archive.dir, ENTRY_FILE)) and os.path.exists(os.path.join(archive.dir, "model.pt"))
    assert any("requirementsFile 'req.txt' is not installed" in w for w in archive.warnings)
    decl = model_decl(archive)
    assert (decl["max_batch_size"], decl["max_delay_us"], decl["timeout_ms"]) == (8, 20_000, 5000)   # the yaml's
    assert decl["inputs"] == [{"name": "request", "dtype": "bytes", "shape": []}]
    assert decl["versions"] == [{"version": "1.0", "handler": f"{archive.dir}/{ENTRY_FILE}:TorchServeEntry"}]
    decl = model_decl(archive, Registration(batch_size=2, max_batch_delay_ms=7, model_name="other"))
    assert (decl["name"], decl["max_batch_size"], decl["max_delay_us"]) == ("other", 2, 7000)   # the registration wins
    assert model_decl(archive, Registration(batch_size=1))["max_delay_us"] == 0   # no batch: no wait
    assert unpack(mar, str(tmp_path / "u")).dir == archive.dir   # unpacked once, by its sha256


def test_tar_gz_and_folder_archives(tmp_path):
    src = tmp_path / "src"
    with zipfile.ZipFile(make_mar(str(tmp_path / "m.mar"))) as z:
        z.extractall(src / "m")    # `-f tgz` puts the files under the model's folder
    with tarfile.open(tmp_path / "m.tar.gz", "w:gz") as t:
        t.add(src / "m", arcname="m")
    assert unpack(str(tmp_path / "m.tar.gz"), str(tmp_path / "u")).name == "m"
    assert unpack(str(src / "m"), str(tmp_path / "u2")).name == "m"   # no-archive: a folder


@pytest.mark.parametrize("kwargs, message", [
    ({"manifest": b"{not json"}, "MAR-INF/MANIFEST.json is not readable JSON"),
    ({"manifest": b'{"runtime": "python"}'}, "MAR-INF/MANIFEST.json has no 'model' object"),
    ({"model": {"handler": ""}}, "names no model.handler"),
    ({"runtime": "LSP"}, "runtime 'LSP' is not served by tgw"),
    ({"model": {"serializedFile": "gone.pt"}}, "model.serializedFile 'gone.pt' is not in the archive"),
    ({"model": {"handler": "other.py:handle"}}, "model.handler 'other.py:handle': the file is not in the archive"),
    ({"files": {"../evil.py": "x"}}, "member '../evil.py' would be written outside the archive's folder"),
])
def test_archives_tgw_cannot_serve_are_refused_with_why(tmp_path, kwargs, message):
    mar = make_mar(str(tmp_path / "bad.mar"), **kwargs)
    with pytest.raises(ArchiveError, match="bad.mar: ") as info:
        unpack(mar, str(tmp_path / "u"))
    assert message in str(info.value)
    assert not [n for n in os.listdir(tmp_path / "u") if n.startswith("bad-")]   # nothing half-unpacked kept


def test_not_an_archive(tmp_path):
    (tmp_path / "x.mar").write_text("plain text")
    with pytest.raises(ArchiveError, match="not a model archive"):
        unpack(str(tmp_path / "x.mar"), str(tmp_path / "u"))


def test_the_store_names_its_archives_only(tmp_path):
    make_mar(str(tmp_path / "a.mar"))
    make_mar(str(tmp_path / "b.mar"), {"modelName": "b"})
    store = ModelStore(str(tmp_path))
    assert store.names() == ["a.mar", "b.mar"]
    assert store.startup(["all"])[1][0] == "b.mar" and store.startup(["x=a.mar"])[0][1].model_name == "x"
    with pytest.raises(ArchiveError, match="tgw downloads no archive"):
        store.path("https://example.com/a.mar")
    with pytest.raises(ArchiveError, match="outside the model store"):
        store.path("../a.mar")
    with pytest.raises(ArchiveError, match="Model file not found in model store: c.mar"):
        store.path("c.mar")


def test_a_start_from_the_store(tmp_path):
    make_mar(str(tmp_path / "a.mar"))
    cfg = with_store(parse_config({"model_store": str(tmp_path), "torchserve": {"models": ["x=a.mar"]}}, str(tmp_path)))
    assert [m.name for m in cfg.models] == ["x"] and cfg._extra_models[0].name == "x"
    assert cfg.models[0].versions[0].format == "stage" and str(tmp_path) in cfg.model_roots[-1]
    with pytest.raises(ConfigError, match="no model is served at start"):
        with_store(parse_config({"model_store": str(tmp_path)}, str(tmp_path)))
    with pytest.raises(ConfigError, match="model_store: Model file not found in model store: zz.mar"):
        with_store(parse_config({"model_store": str(tmp_path), "torchserve": {"models": ["zz.mar"]}}, str(tmp_path)))
    with pytest.raises(ConfigError, match="torchserve.models names archives of model_store, which is not set"):
        parse_config({"torchserve": {"models": ["all"]}, "models": []}, str(tmp_path))
