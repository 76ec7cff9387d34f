"""What the config tests share (tests/unit/test_config.py, test_config_models.py,
test_config_files.py and tests/process/test_check_config.py): a valid config of two models, its
folder with their files, and the ways to refuse or write one."""
from __future__ import annotations

import pytest

from conftest import unloaded_model
from tgw.broker.config.load import ConfigError, parse_config


def make_model_dir(tmp_path):
    """The config's folder (its real path: parse_config returns real paths), holding models/."""
    base = tmp_path.resolve()
    (base / "models").mkdir()
    for name in ("a1.pt", "a2.pt", "b1.pt"):
        unloaded_model(base / "models" / name, name.encode())
    return base


def valid() -> dict:
    return {
        "server": {"address": "ipc:///tmp/tgw-test/tgw.sock", "max_request_bytes": 1 << 20},
        "workers": {"devices": ["cpu", "cpu"], "threads_per_worker": 1, "pin_cpus": True},
        "models": [
            {
                "name": "a",
                "versions": [{"version": "1", "path": "models/a1.pt"},
                             {"version": "2", "path": "models/a2.pt"}],
                "default_version": "1",
                "inputs": [{"name": "x", "dtype": "float32", "shape": [4]}],
                "outputs": [{"name": "y", "dtype": "float32", "shape": [2]}],
                "max_batch_size": 8,
                "warmup_batch_sizes": [1, 8],
            },
            {
                "name": "b",
                "versions": [{"version": "1", "path": "models/b1.pt"}],
                "inputs": [{"name": "tokens", "dtype": "int64", "shape": [-1]},
                           {"name": "mask", "dtype": "bool", "shape": [-1]}],
                "outputs": [{"name": "logits", "dtype": "float16", "shape": [-1, 3]}],
            },
        ],
    }


def problems(data, base_dir) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, str(base_dir))
    return str(info.value)


def set_weights(*weights):
    """Weights on model a's versions (default_version dropped: the two are exclusive)."""
    def mutate(d):
        d["models"][0].pop("default_version")
        for v, w in zip(d["models"][0]["versions"], weights):
            v["weight"] = w
    return mutate


def write(model_dir, text: str) -> str:
    path = model_dir / "tgw.yaml"
    path.write_text(text)
    return str(path)
