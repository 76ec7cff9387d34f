"""Config validation, the model files' side (broker/config/load.py): where model files may lie
(model_roots), version weights, residency and max_model_memory."""
from __future__ import annotations

import pytest
import yaml

from conftest import unloaded_model
from config_cases import make_model_dir, problems, set_weights, valid, write
from tgw.broker.config.load import Config, load_config, parse_config


@pytest.fixture
def model_dir(tmp_path):
    return make_model_dir(tmp_path)


# ---- model_roots: where model files may lie -------------------------------------------------------

def test_model_roots_default_to_the_config_folder(model_dir):
    cfg = parse_config(valid(), str(model_dir))
    assert cfg.model_roots == [str(model_dir)]


def test_relative_model_roots_resolve_against_the_config_folder(model_dir, monkeypatch):
    data = valid()
    data["model_roots"] = ["models", str(model_dir / "models" / ".")]
    path = write(model_dir, yaml.safe_dump(data))
    monkeypatch.chdir("/")                       # not against the working directory
    cfg = load_config(path)
    assert cfg.model_roots == [str(model_dir / "models")] * 2


def test_missing_model_root_is_named(model_dir):
    data = valid()
    data["model_roots"] = ["models", "gone", "models/a1.pt"]
    msg = problems(data, model_dir)
    assert f"model_roots.1: not a directory: {model_dir}/gone" in msg
    assert f"model_roots.2: not a directory: {model_dir}/models/a1.pt" in msg
    assert "2 problem(s)" in msg                 # no model is outside: models/ is still a root


def test_missing_config_folder_is_named_when_model_roots_is_empty(model_dir):
    msg = problems(valid(), model_dir / "gone")
    assert f"model_roots (empty: the config file's folder): not a directory: {model_dir}/gone" in msg


def test_model_outside_the_roots_is_named(model_dir):
    (model_dir / "elsewhere").mkdir()
    unloaded_model(model_dir / "elsewhere" / "x.pt")
    data = valid()
    data["model_roots"] = ["models"]
    data["models"][0]["versions"][1]["path"] = "elsewhere/x.pt"
    data["models"][1]["versions"][0]["path"] = "/etc/passwd"
    msg = problems(data, model_dir)
    roots = f"model_roots [{model_dir}/models]"
    assert f"models.0.versions.1.path: {model_dir}/elsewhere/x.pt is outside {roots}" in msg
    assert f"models.1.versions.0.path: /etc/passwd is outside {roots}" in msg
    assert "2 problem(s)" in msg


def test_model_root_prefix_is_not_a_root(model_dir):
    (model_dir / "models2").mkdir()
    unloaded_model(model_dir / "models2" / "x.pt")
    data = valid()
    data["model_roots"] = ["models"]
    data["models"][1]["versions"][0]["path"] = "models2/x.pt"
    assert f"{model_dir}/models2/x.pt is outside model_roots" in problems(data, model_dir)


def test_model_path_with_dotdot_is_refused(model_dir):
    data = valid()
    data["models"][0]["versions"][0]["path"] = "models/../models/a1.pt"
    msg = problems(data, model_dir)
    assert f"models.0.versions.0.path: {model_dir}/models/../models/a1.pt contains '..'" in msg


def test_model_symlink_escaping_the_roots_is_refused(model_dir):
    unloaded_model(model_dir / "secret.pt")
    (model_dir / "models" / "link.pt").symlink_to(model_dir / "secret.pt")
    data = valid()
    data["model_roots"] = ["models"]
    data["models"][1]["versions"][0]["path"] = "models/link.pt"
    assert (f"models.1.versions.0.path: {model_dir}/models/link.pt is a symlink that resolves to "
            f"{model_dir}/secret.pt, outside model_roots [{model_dir}/models]") in problems(data, model_dir)


def test_model_paths_come_back_as_the_real_files(model_dir):
    (model_dir / "models" / "current.pt").symlink_to(model_dir / "models" / "b1.pt")
    data = valid()
    data["models"][1]["versions"][0]["path"] = "./models/current.pt"
    assert parse_config(data, str(model_dir)).models[1].versions[0].path == str(model_dir / "models" / "b1.pt")


def test_root_file_and_schema_problems_reported_together(model_dir):
    data = valid()
    data["model_roots"] = ["models", "gone"]
    data["models"][0]["versions"][0]["path"] = "/etc/passwd"
    data["models"][0]["versions"][1]["path"] = "models/nope.pt"
    data["models"][1]["versions"][0]["sha256"] = "0" * 64
    data["workers"]["max_model_memory"] = 2.0
    msg = problems(data, model_dir)
    for key in ("model_roots.1", "models.0.versions.0.path", "models.0.versions.1.path", "models.1.versions.0.sha256",
                "workers.max_model_memory"):
        assert f"  {key}: " in msg, msg
    assert "5 problem(s)" in msg


# ---- version weights, residency, max_model_memory -------------------------------------------------

def weighted(model_dir, *weights) -> Config:
    data = valid()
    set_weights(*weights)(data)
    return parse_config(data, str(model_dir))


def test_weights_split_requests_that_name_no_version(model_dir):
    a = weighted(model_dir, 1, 3).model("a")
    assert a.weighted and a.weights() == {"1": 1, "2": 3} and a.default == "2"
    assert weighted(model_dir, 5, 0).model("a").default == "1"


def test_a_missing_weight_counts_zero(model_dir):
    a = weighted(model_dir, None, 2).model("a")
    assert a.weights() == {"1": 0, "2": 2} and a.default == "2"


def test_tied_weights_default_to_the_later_version(model_dir):
    assert weighted(model_dir, 2, 2).model("a").default == "2"


def test_without_weights_the_default_version_takes_everything(model_dir):
    cfg = parse_config(valid(), str(model_dir))
    assert not cfg.model("a").weighted
    assert cfg.model("a").weights() == {"1": 100}                 # default_version
    assert cfg.model("b").weights() == {"1": 100}                 # the last version


@pytest.mark.parametrize("residency", ["always", "on_demand"])
def test_residency(model_dir, residency):
    data = valid()
    data["models"][1]["residency"] = residency
    cfg = parse_config(data, str(model_dir))
    assert (cfg.model("a").residency, cfg.model("b").residency) == ("always", residency)


@pytest.mark.parametrize("text, value", [("2000000000", 2_000_000_000), ("1048576", 1 << 20), ("0.5", 0.5),
                                         ("1.0", 1.0), ("null", None)])
def test_max_model_memory_bytes_or_share(model_dir, text, value):
    data = valid()
    del data["workers"]
    path = write(model_dir, yaml.safe_dump(data) + f"workers:\n  max_model_memory: {text}\n")
    got = load_config(path).workers.max_model_memory
    assert got == value and type(got) is type(value)


def test_max_model_memory_defaults_to_no_budget(model_dir):
    assert parse_config(valid(), str(model_dir)).workers.max_model_memory is None
