"""Config files (broker/config/load.py load_config): every refusal names the file and the key path;
YAML tags are never executed. (`tgw-broker check-config` on them: tests/process/test_check_config.py.)"""
from __future__ import annotations

import pytest
import yaml

from config_cases import make_model_dir, valid, write
from tgw.broker.config.load import ConfigError, load_config


@pytest.fixture
def model_dir(tmp_path):
    return make_model_dir(tmp_path)


# ---- load_config: files ------------------------------------------------------------------------

def test_load_config_valid_resolves_against_config_folder(model_dir, monkeypatch):
    path = write(model_dir, yaml.safe_dump(valid()))
    monkeypatch.chdir("/")                       # relative model paths are not cwd-relative
    cfg = load_config(path)
    assert cfg.models[0].versions[0].path == str(model_dir / "models" / "a1.pt")


def test_load_config_error_names_file_and_key(model_dir):
    data = valid()
    data["models"][0]["batching"] = {}
    path = write(model_dir, yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert path in str(info.value) and "models.0.batching" in str(info.value)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n", "", "# only a comment\n"])
def test_load_config_non_mapping(model_dir, text):
    path = write(model_dir, text)
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)


@pytest.mark.parametrize("text", ["models: [\n", "a: b: c\n", "models:\n  - name: x\n bad_indent: 1\n",
                                  "key: 'unterminated\n"])
def test_load_config_invalid_yaml(model_dir, text):
    path = write(model_dir, text)
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_load_config_unreadable(model_dir):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(str(model_dir / "missing.yaml"))
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(str(model_dir))              # a directory


def test_load_config_not_utf8(model_dir):
    path = model_dir / "tgw.yaml"
    path.write_bytes(b"models:\n  - name: \xff\xfe\n")
    with pytest.raises(ConfigError):
        load_config(str(path))


def test_yaml_tags_not_executed(model_dir):
    path = write(model_dir, "models: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
