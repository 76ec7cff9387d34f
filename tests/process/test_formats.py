"""Model formats (issue 13): TorchScript, torch.export programs and AOTInductor packages.

The format is told from the file (or declared and checked) by config validation, check-config
and runtime loads alike; the worker loads each format its own way and refuses, at load, a
program whose batch range or dims disagree with the declaration, naming the dim. Served answers
equal the program run in this process. AOTInductor tests need a C++ compiler (skipped without).
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import urllib.request
import zipfile

import numpy as np
import pytest
import torch

from tgw.testing.lifecycle import control
from conftest import readme_block
from tgw.broker.config.load import ConfigError, parse_config
from tgw.client import Client, TgwError
from tgw.shm.errors import Code
from tgw.shm.model_format import ModelFormatError, detect
from tgw.shm.wire import IOSpec, LoadVersion, ModelSpec
from tgw.workers.demo_models import DEMO_MODELS, MLP, TokenEmbed, build_file, build_module, cxx_compiler, save_model
from tgw.workers.formats import FormatMismatch, load_in_process
from tgw.workers.runner import ModelRunner

needs_cxx = pytest.mark.skipif(cxx_compiler() is None, reason="AOTInductor needs a C++ compiler")
MLP_IO = DEMO_MODELS["mlp"][2]
EMBED_IO = DEMO_MODELS["embed"][2]
T_MAX = 16   # the token dim's range in the test's embed program


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """mlp in every format (the demo's files, same weights), embed as a program with tokens
    1..T_MAX, and mlp programs with a static batch of 4 and a batch range of 1..8."""
    out = str(tmp_path_factory.mktemp("formats"))
    paths = {f"mlp-{fmt}": build_file(out, "mlp", fmt) for fmt in ("torchscript", "export")}
    if cxx_compiler() is not None:
        paths["mlp-aoti"] = build_file(out, "mlp", "aoti")
    x4 = (torch.randn(4, 256),)
    batch = torch.export.Dim("batch", min=1, max=32)
    paths["embed-export"] = save_model(build_module("embed"), (torch.randint(0, 1000, (4, 7)),),
                                       os.path.join(out, "embed.pt2"), "export",
                                       ({0: batch, 1: torch.export.Dim("tokens", min=1, max=T_MAX)},))
    paths["mlp-static"] = save_model(MLP().eval(), x4, os.path.join(out, "static.pt2"), "export")
    paths["mlp-narrow"] = save_model(MLP().eval(), x4, os.path.join(out, "narrow.pt2"), "export",
                                     ({0: torch.export.Dim("batch", min=1, max=8)},))
    return paths


def spec(path: str, fmt: str, io_decl: dict = MLP_IO, max_batch_size: int = 64, warmup=(1,), **shape) -> ModelSpec:
    inputs = [IOSpec(name=t["name"], dtype=shape.get("dtype", t["dtype"]), shape=shape.get("shape", t["shape"]))
              for t in io_decl["inputs"]]
    outputs = [IOSpec(**t) for t in io_decl["outputs"]]
    return ModelSpec(name="m", version="1", path=path, inputs=inputs, outputs=outputs, format=fmt,
                     max_batch_size=max_batch_size, warmup_batch_sizes=list(warmup))


def refusal(s: ModelSpec) -> str:
    with pytest.raises(FormatMismatch) as info:
        ModelRunner(s, torch.device("cpu")).warm_up()
    return str(info.value)


# ---- telling the format from the file ----------------------------------------------------------

def test_each_format_is_told_from_its_file(files):
    assert detect(files["mlp-torchscript"]) == "torchscript"
    assert detect(files["mlp-export"]) == "export"
    if "mlp-aoti" in files:
        assert detect(files["mlp-aoti"]) == "aoti"
    with open(files["mlp-export"], "rb") as f:   # the worker tells it from its private copy the same way
        assert detect(f, "export") == "export"


def test_a_file_that_is_no_servable_model_is_named_with_what_it_is(tmp_path, files):
    ckpt = tmp_path / "weights.pt"
    torch.save(MLP().state_dict(), ckpt)
    with pytest.raises(ModelFormatError, match=r"weights\.pt: a torch\.save checkpoint .* not a servable program"):
        detect(str(ckpt))
    (tmp_path / "x.pt").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelFormatError, match=r"x\.pt is not a zip archive"):
        detect(str(tmp_path / "x.pt"))
    with pytest.raises(ModelFormatError) as info:
        detect(files["mlp-export"], "torchscript")
    assert str(info.value) == (f"{files['mlp-export']} is declared format: torchscript but is a torch.export program "
                               "(torch.export.save)")


@needs_cxx
def test_an_archive_holding_both_pt2_formats_needs_its_format_declared(tmp_path, files):
    both = tmp_path / "both.pt2"
    with zipfile.ZipFile(both, "w") as out:
        for src in (files["mlp-export"], files["mlp-aoti"]):
            with zipfile.ZipFile(src) as archive:
                for name in archive.namelist():
                    if name.split("/", 1)[1] not in {n.split("/", 1)[1] for n in out.namelist()}:
                        out.writestr("both/" + name.split("/", 1)[1], archive.read(name))
    with pytest.raises(ModelFormatError, match="holds a torch.export program .* and an AOTInductor package .*: set "
                                               "the version's format"):
        detect(str(both))
    assert detect(str(both), "aoti") == "aoti" and detect(str(both), "export") == "export"


def test_config_reads_the_format_and_names_a_mismatch_by_key(tmp_path, files):
    def config(fmt=None) -> dict:
        version = {"version": "1", "path": files["mlp-export"], **({"format": fmt} if fmt else {})}
        return {"model_roots": ["/"], "models": [{"name": "m", "versions": [version], **MLP_IO}]}
    assert parse_config(config(), str(tmp_path)).models[0].versions[0].format == "export"
    assert parse_config(config("export"), str(tmp_path)).models[0].versions[0].format == "export"
    with pytest.raises(ConfigError) as info:
        parse_config(config("aoti"), str(tmp_path))
    assert (f"models.0.versions.0.format: {files['mlp-export']} is declared format: aoti but is a torch.export "
            "program") in str(info.value)
    with pytest.raises(ConfigError) as info:   # an ONNX model is a format too, told from the file
        parse_config(config("onnx"), str(tmp_path))
    assert (f"models.0.versions.0.format: {files['mlp-export']} is declared format: onnx but is a torch.export "
            "program") in str(info.value)
    with pytest.raises(ConfigError, match="models.0.versions.0.format: Input should be 'torchscript', 'export', 'aoti', "
                                          "'onnx' or 'stage'"):
        parse_config(config("tensorrt"), str(tmp_path))


def test_check_config_validates_the_same_way(tmp_path, files):
    cfg = tmp_path / "tgw.yaml"
    cfg.write_text(f"model_roots: [/]\nmodels:\n  - name: m\n    versions:\n      - version: '1'\n"
                   f"        path: {files['mlp-export']}\n        format: aoti\n"
                   "    inputs: [{name: x, dtype: float32, shape: [256]}]\n"
                   "    outputs: [{name: y, dtype: float32, shape: [10]}]\n")
    cli = [sys.executable, "-m", "tgw.broker", "check-config", str(cfg)]
    r = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "models.0.versions.0.format:" in r.stderr and "is declared format: aoti" in r.stderr
    cfg.write_text(cfg.read_text().replace("format: aoti", "format: export"))
    r = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "m: version 1 (export)" in r.stdout


# ---- what the worker refuses at load -----------------------------------------------------------

def test_a_batch_range_short_of_max_batch_size_is_refused_at_load(files):
    message = refusal(spec(files["mlp-narrow"], "export", max_batch_size=16, warmup=[1, 16]))
    assert "input 'x' batch dim allows 1..8 in the program, but the broker batches 1..16 rows" in message
    assert "[16] fall outside" in message and "Dim('batch', min=1, max=16)" in message
    ModelRunner(spec(files["mlp-narrow"], "export", max_batch_size=8, warmup=[1, 8]), torch.device("cpu")).warm_up()


def test_a_static_batch_is_refused_naming_it(files):
    message = refusal(spec(files["mlp-static"], "export", max_batch_size=8))
    assert "input 'x' batch dim allows static 4 in the program" in message and "[1, 8] fall outside" in message


def test_a_declared_variable_dim_that_is_static_in_the_program_is_refused_by_name(files):
    message = refusal(spec(files["mlp-export"], "export", shape=[-1]))
    assert "input 'x' shape[0] (tensor dim 1) is declared -1 (variable) but is static 256 in the exported program" \
        in message


def test_dtype_and_fixed_dims_are_checked_against_the_program(files):
    assert "input 'x' is float64 in the config but float32 in the program" in refusal(
        spec(files["mlp-export"], "export", dtype="float64"))
    assert "input 'x' shape[0] (tensor dim 1) is declared 128; the program allows static 256" in refusal(
        spec(files["mlp-export"], "export", shape=[128]))
    assert "input 'tokens' shape[0] (tensor dim 1) is declared 32; the program allows 1..16" in refusal(
        spec(files["embed-export"], "export", EMBED_IO, max_batch_size=8, shape=[32]))


@needs_cxx
def test_an_aoti_package_is_refused_at_its_edges(files):
    message = refusal(spec(files["mlp-aoti"], "aoti", max_batch_size=128, warmup=[1]))
    assert "input 'x' batch dim: a batch of 128 rows is refused by the AOTInductor package" in message
    assert "expected to be <= 64" in message
    message = refusal(spec(files["mlp-aoti"], "aoti", shape=[-1]))
    assert "input 'x' shape[0] (tensor dim 1) is declared -1 (variable) but the AOTInductor package refuses" in message


def test_a_variable_dim_outside_the_programs_range_is_the_callers_error(files):
    runner = ModelRunner(spec(files["embed-export"], "export", EMBED_IO, max_batch_size=8), torch.device("cpu"))
    runner.warm_up()
    assert runner.run([torch.zeros(2, T_MAX, dtype=torch.int64)], 2)[0].shape == (2, 32)
    with pytest.raises(TgwError) as info:
        runner.run([torch.zeros(2, T_MAX + 1, dtype=torch.int64)], 2)
    assert info.value.code is Code.INVALID_ARGUMENT
    assert info.value.message == f"input 'tokens' shape[0] (tensor dim 1) is {T_MAX + 1}; the model allows 1..{T_MAX}"


# ---- serving -----------------------------------------------------------------------------------

def served_config(files: dict, names: list[str]) -> dict:
    models = []
    for name in names:
        io_decl = EMBED_IO if name.startswith("embed") else MLP_IO
        models.append({"name": name, "versions": [{"version": "1", "path": files[name]}], **io_decl,
                       "max_batch_size": 8 if name.startswith("embed") else 64, "warmup_batch_sizes": [1, 8]})
    return {"model_roots": ["/"], "models": models,
            "workers": {"devices": ["cpu"], "input_arena_mb": 8, "output_arena_mb": 4}}


def in_process(path: str, fmt: str, *inputs: np.ndarray) -> list[np.ndarray]:
    with torch.inference_mode():
        out = load_in_process(fmt, path).call(*[torch.from_numpy(x) for x in inputs])
    out = out.values() if isinstance(out, dict) else [out] if isinstance(out, torch.Tensor) else out
    return [t.numpy() for t in out]


def test_every_format_serves_what_its_program_computes_in_process(files, make_broker):
    names = [n for n in ("mlp-torchscript", "mlp-export", "mlp-aoti", "embed-export") if n in files]
    b = make_broker(served_config(files, names))
    rng = np.random.default_rng(13)
    with Client(b.address) as c:
        by_name = {m["name"]: m for m in c.models()}
        assert set(by_name) == set(names) and all(m["ready"] for m in by_name.values())
        for rows in (1, 3, 8):
            x = rng.standard_normal((rows, 256), dtype=np.float32)
            answers = {n: c.infer(n, {"x": x})["y"] for n in names if n.startswith("mlp")}
            for n, y in answers.items():
                fmt = n.split("-", 1)[1]
                np.testing.assert_allclose(y, in_process(files[n], fmt, x)[0], rtol=1e-5, atol=1e-6, err_msg=n)
                np.testing.assert_allclose(y, answers["mlp-torchscript"], rtol=1e-4, atol=1e-5, err_msg=n)
        for t in (1, 5, T_MAX):
            tokens = rng.integers(0, 5000, (2, t), dtype=np.int64)
            out = c.infer("embed-export", {"tokens": tokens})
            ref = in_process(files["embed-export"], "export", tokens)
            np.testing.assert_allclose(out["embedding"], ref[0], rtol=1e-5, atol=1e-6)
            assert out["length"].tolist() == [t, t]
        with pytest.raises(TgwError) as info:
            c.infer("embed-export", {"tokens": np.zeros((1, T_MAX + 1), dtype=np.int64)})
        assert info.value.code is Code.INVALID_ARGUMENT and f"allows 1..{T_MAX}" in info.value.message
        assert c.infer("embed-export", {"tokens": np.zeros((1, 2), dtype=np.int64)})["length"].tolist() == [2]


def test_a_program_that_cannot_take_every_batch_stops_start_up(files, make_broker):
    cfg = served_config(files, ["mlp-narrow"])
    b = make_broker(cfg, start=False)
    b.start(wait=False)
    assert b.proc.wait(120) != 0
    assert "input 'x' batch dim allows 1..8 in the program, but the broker batches 1..64 rows" in b.output()


def test_runtime_loads_check_the_format_and_swap_torchscript_for_export(files, make_broker):
    b = make_broker({**served_config(files, ["mlp-torchscript"]), "http": {"port": 0}})
    x = np.random.default_rng(1).standard_normal((2, 256), dtype=np.float32)
    with Client(b.address) as c:
        before = c.infer("mlp-torchscript", {"x": x})["y"]
    with pytest.raises(TgwError) as info:
        control(b.address, LoadVersion(v=0, model="mlp-torchscript", version="2", path=files["mlp-export"],
                                       format="aoti"))
    assert info.value.code is Code.INVALID_ARGUMENT and info.value.details["reason"] == "format"
    assert "is declared format: aoti but is a torch.export program" in info.value.message
    with pytest.raises(TgwError) as info:
        control(b.address, LoadVersion(v=0, model="mlp-torchscript", version="2", path=files["mlp-narrow"]))
    assert "batch dim allows 1..8" in info.value.message and "(format)" in info.value.message
    control(b.address, LoadVersion(v=0, model="mlp-torchscript", version="3", path=files["mlp-export"]))
    with Client(b.address) as c:
        after = c.infer("mlp-torchscript", {"x": x})
        meta = c.metadata("mlp-torchscript")[0]
        url = c.status()["http"]
    np.testing.assert_allclose(after["y"], before, rtol=1e-4, atol=1e-5)
    assert [(v["version"], v["format"]) for v in meta["versions"]] == [("3", "export")]
    with urllib.request.urlopen(f"{url}/v2/models/mlp-torchscript", timeout=30) as reply:   # KServe metadata
        assert json.load(reply)["platform"] == "pytorch_export"


def test_save_model_writes_each_format_a_reader_can_load(tmp_path):
    module, x = TokenEmbed().eval(), torch.randint(0, 1000, (3, 5))
    path = save_model(module, (x,), str(tmp_path / "e.pt"), "torchscript")
    assert detect(path) == "torchscript" and not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]
    with torch.inference_mode():
        assert torch.equal(load_in_process("torchscript", path).call(x)["embedding"], module(x)["embedding"])
        data = io.BytesIO(open(path, "rb").read())
        assert detect(data) == "torchscript"


@needs_cxx
def test_the_readmes_recipe_writes_a_file_of_each_format_that_serves_every_batch(tmp_path):
    subprocess.run([sys.executable, "-c", readme_block("model-export")], cwd=tmp_path, check=True, timeout=600,
                   capture_output=True)
    io_decl = {"inputs": MLP_IO["inputs"], "outputs": MLP_IO["outputs"]}
    x = torch.randn(3, 256)
    results = []
    for name, fmt in (("model.pt", "torchscript"), ("model.pt2", "export"), ("model-aoti.pt2", "aoti")):
        path = str(tmp_path / name)
        assert detect(path) == fmt
        runner = ModelRunner(spec(path, fmt, io_decl, max_batch_size=64, warmup=[1, 64]), torch.device("cpu"))
        runner.warm_up()   # 1 and 64 rows: the AOTInductor package, compiled from the loaded program, takes both
        results.append(runner.run([x], 3)[0])
    torch.testing.assert_close(results[1], results[0])
    torch.testing.assert_close(results[2], results[0], rtol=1e-4, atol=1e-5)


def test_without_a_cxx_compiler_the_demo_skips_its_aoti_model_and_says_so(tmp_path, monkeypatch):
    from tgw.workers.demo_models import build_demo_models
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    said: list[str] = []
    built = build_demo_models(str(tmp_path / "demo"), formats=True, log=said.append)
    assert "mlp-aoti" not in built and built["mlp-export"]["format"] == "export"
    assert said == ["mlp-aoti: skipped, no C++ compiler found ($CXX, c++, g++, clang++) to build the AOTInductor "
                    "package"]


def test_an_aoti_packages_cpu_isa_is_checked_against_this_cpus_flags():
    from tgw.workers.formats import missing_cpu_features
    avx2_only = {"fpu", "sse4_2", "avx", "avx2"}
    assert missing_cpu_features("AVX512 AVX512_VNNI", avx2_only) == ["avx512f", "avx512_vnni"]
    assert missing_cpu_features("AVX512 AVX512_VNNI AMX_TILE", avx2_only | {"avx512f", "avx512_vnni"}) == ["amx_tile"]
    assert missing_cpu_features("AVX2", avx2_only) == []
    assert missing_cpu_features("INVALID_VEC_ISA", avx2_only) == []   # no vector code: nothing needed
    assert missing_cpu_features("ASIMD", set()) == []                   # flags unknown (not x86): not checked
