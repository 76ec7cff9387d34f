"""Config validation (broker/config/load.py): every refusal is a ConfigError naming its key path
(the model files' side: test_config_models.py; files and `tgw-broker check-config`:
test_config_files.py)."""
from __future__ import annotations

import hashlib
import os

import pytest

from config_cases import make_model_dir, problems, set_weights, valid
from tgw.broker.config.load import Config, ConfigError, file_sha256, parse_config


@pytest.fixture
def model_dir(tmp_path):
    return make_model_dir(tmp_path)


def test_valid_config_parses(model_dir):
    cfg = parse_config(valid(), str(model_dir))
    assert isinstance(cfg, Config)
    a, b = cfg.models
    assert [v.path for v in a.versions] == [str(model_dir / "models" / "a1.pt"), str(model_dir / "models" / "a2.pt")]
    assert os.path.isabs(b.versions[0].path)
    assert a.default == "1" and b.default == "1"
    assert b.max_batch_size == 32 and b.max_queue >= 1          # defaults
    assert cfg.workers.devices == ["cpu", "cpu"] and cfg.workers.pin_cpus
    assert cfg.model("b").inputs[0].shape == [-1]


def test_minimal_config_defaults(model_dir):
    data = {"models": [valid()["models"][1]]}
    cfg = parse_config(data, str(model_dir))
    assert cfg.workers.devices == "auto"
    assert cfg.server.address is None


def test_sha256_match_and_absolute_path(model_dir):
    data = {"model_roots": [str(model_dir)], "models": [valid()["models"][0]]}
    path = model_dir / "models" / "a1.pt"
    data["models"][0]["versions"] = [{"version": "1", "path": str(path),
                                      "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}]
    cfg = parse_config(data, "/nonexistent-base")   # absolute paths and roots ignore the base folder
    assert cfg.models[0].versions[0].path == str(path)
    assert file_sha256(str(path)) == hashlib.sha256(path.read_bytes()).hexdigest()


def _set(path: str, value):
    """A mutation of valid() that sets the dotted key path to value."""
    def mutate(d):
        *parents, last = path.split(".")
        node = d
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return mutate


def _dup_model(d):
    d["models"][1]["name"] = "a"


def _dup_version(d):
    d["models"][0]["versions"][1]["version"] = "1"


def _dup_input(d):
    d["models"][1]["inputs"][1]["name"] = "tokens"


# (id, mutation, key path that must be named, fragment of the message)
CASES = [
    ("unknown_top", _set("bogus", 1), "bogus", "unknown key"),
    ("unknown_model_key", _set("models.0.batching", {"max_delay_us": 100}), "models.0.batching", "unknown key"),
    ("unknown_server_key", _set("server.port", 80), "server.port", "unknown key"),
    ("unknown_tensor_key", _set("models.1.inputs.0.layout", "nchw"), "models.1.inputs.0.layout", "unknown key"),
    ("wrong_type_int", _set("models.0.max_batch_size", "big"), "models.0.max_batch_size", "integer"),
    ("wrong_type_list", _set("models.0.versions", "1"), "models.0.versions", "list"),
    ("wrong_type_shape", _set("models.0.inputs.0.shape", "4"), "models.0.inputs.0.shape", "list"),
    ("batch_too_big", _set("models.0.max_batch_size", 4097), "models.0.max_batch_size", "less than"),
    ("missing_models", lambda d: d.pop("models"), "models", "required"),
    ("missing_name", lambda d: d["models"][0].pop("name"), "models.0.name", "required"),
    ("empty_versions", _set("models.0.versions", []), "models.0.versions", ""),
    ("bad_dtype", _set("models.0.inputs.0.dtype", "complex64"), "models.0.inputs.0.dtype", "unknown dtype"),
    ("bad_out_dtype", _set("models.1.outputs.0.dtype", "float"), "models.1.outputs.0.dtype", "unknown dtype"),
    ("shape_zero", _set("models.0.inputs.0.shape", [0]), "models.0.inputs.0.shape", "dims"),
    ("shape_neg", _set("models.0.inputs.0.shape", [4, -2]), "models.0.inputs.0.shape", "dims"),
    ("dup_model", _dup_model, "models", "duplicate model name"),
    ("dup_version", _dup_version, "models.0", "duplicate version"),
    ("dup_input", _dup_input, "models.1", "duplicate input name"),
    ("default_version", _set("models.0.default_version", "7"), "models.0", "default_version"),
    ("warmup", _set("models.0.warmup_batch_sizes", [1, 16]), "models.0", "warmup_batch_sizes"),
    ("bad_scheme", _set("server.address", "http://localhost:8000"), "server.address", "ipc:// or tcp://"),
    ("ipc_too_long", _set("server.address", "ipc:///tmp/" + "x" * 120), "server.address", "107"),
    ("bad_device", _set("workers.devices", ["gpu0"]), "workers.devices", ""),
    ("bad_sha_format", _set("models.0.versions.0.sha256", "xyz"), "models.0.versions.0.sha256", ""),
    ("bad_model_name", _set("models.0.name", "a b/c"), "models.0.name", ""),
    ("weights_sum_zero", set_weights(0, 0), "models.0", "weights of model 'a' sum to 0: at least one version needs"),
    ("weight_and_default", _set("models.0.versions.1.weight", 1), "models.0",
     "default_version and per-version weight are exclusive: requests that name no version follow the weights"),
    ("weight_negative", set_weights(-1, 1), "models.0.versions.0.weight", "greater than or equal to 0"),
    ("weight_too_big", set_weights(1, 1_000_001), "models.0.versions.1.weight", "less than or equal to 1000000"),
    ("weight_float", set_weights(0.5, 1), "models.0.versions.0.weight", "integer"),
    ("residency", _set("models.0.residency", "sometimes"), "models.0.residency", "'always' or 'on_demand'"),
    ("model_roots_string", _set("model_roots", "models"), "model_roots", "list"),
    ("model_roots_empty_entry", _set("model_roots", [""]), "model_roots.0", "at least 1 character"),
    ("reshape_elements", _set("models.0.inputs.0.reshape", [3]), "models.0",
     "tensor 'x': reshape [3] does not hold the elements of shape [4]"),
    ("reshape_variable", _set("models.1.inputs.0.reshape", [2, 2]), "models.1", "as many -1 dims"),
    ("labels_missing", _set("models.0.outputs.0.labels", "nope.txt"), "models.0.outputs.0.labels",
     "label file"),
    ("format_unknown", _set("models.0.inputs.0.format", "NCHW"), "models.0.inputs.0.format", "FORMAT_NCHW"),
    ("no_batch_dim_warmup", _set("models.0.max_batch_size", 0), "models.0", "warmup_batch_sizes [8] exceed"),
    *[(f"max_model_memory_{name}", _set("workers.max_model_memory", value), "workers.max_model_memory",
       f"must be bytes (a whole number >= 1048576) or a share of device memory in (0, 1], got {value!r}")
      for name, value in [("bool", True), ("text", "1GB"), ("zero", 0), ("zero_share", 0.0), ("over_one", 1.5),
                          ("under_mib", 1), ("negative", -0.5)]],
]


@pytest.mark.parametrize("mutate, key, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_config_names_key_path(model_dir, mutate, key, fragment):
    data = valid()
    mutate(data)
    msg = problems(data, model_dir)
    lines = msg.splitlines()
    assert any(line.strip().startswith(key) or f" {key}" in line for line in lines[1:]), msg
    assert fragment in msg, msg


def test_missing_model_file(model_dir):
    data = valid()
    data["models"][0]["versions"][1]["path"] = "models/nope.pt"
    msg = problems(data, model_dir)
    assert "models.0.versions.1.path" in msg and "not found" in msg
    assert str(model_dir / "models" / "nope.pt") in msg


def test_model_path_is_a_directory(model_dir):
    data = valid()
    data["models"][0]["versions"][0]["path"] = "models"
    assert "models.0.versions.0.path" in problems(data, model_dir)


def test_sha256_mismatch(model_dir):
    data = valid()
    data["models"][1]["versions"][0]["sha256"] = "0" * 64
    msg = problems(data, model_dir)
    assert "models.1.versions.0.sha256" in msg and "does not match" in msg
    assert file_sha256(str(model_dir / "models" / "b1.pt")) in msg


def test_ipc_path_limit_boundary(model_dir):
    prefix = "ipc://"
    ok = valid()
    ok["server"]["address"] = prefix + "/tmp/" + "x" * (107 - len("/tmp/"))   # exactly 107 bytes
    parse_config(ok, str(model_dir))
    bad = valid()
    bad["server"]["address"] = prefix + "/tmp/" + "x" * (108 - len("/tmp/"))
    assert "server.address" in problems(bad, model_dir)


def test_tcp_address_needs_curve_keys(model_dir, tmp_path):
    data = valid()
    data["server"]["address"] = "tcp://127.0.0.1:5555"
    with pytest.raises(ConfigError, match="server: .*curve_secret_key_file"):
        parse_config(data, str(model_dir))
    key = tmp_path / "broker.key_secret"
    key.write_text("not checked here")
    key.chmod(0o640)
    data["server"]["curve_secret_key_file"] = str(key)
    cfg = parse_config(data, str(model_dir))
    assert (cfg.server.address, cfg.server.curve_secret_key_file) == ("tcp://127.0.0.1:5555", str(key))
    key.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by every user"):
        parse_config(data, str(model_dir))


def test_socket_dir_mode_must_be_private(model_dir):
    data = valid()
    data["server"]["socket_dir_mode"] = "0770"
    with pytest.raises(ConfigError, match="server.socket_dir_mode: .*other users replace the socket"):
        parse_config(data, str(model_dir))


def test_several_problems_at_once(model_dir):
    data = valid()
    data["bogus"] = True
    data["models"][0]["max_batch_size"] = "big"
    data["models"][1]["inputs"][0]["dtype"] = "complex64"
    data["server"]["address"] = "http://x"
    msg = problems(data, model_dir)
    for key in ("bogus", "models.0.max_batch_size", "models.1.inputs.0.dtype", "server.address"):
        assert key in msg, msg
    assert "4 problem(s)" in msg


def test_several_missing_files_at_once(model_dir):
    data = valid()
    for m in data["models"]:
        for v in m["versions"]:
            v["path"] = "gone/" + v["path"]
    msg = problems(data, model_dir)
    for key in ("models.0.versions.0.path", "models.0.versions.1.path", "models.1.versions.0.path"):
        assert key in msg
    assert "3 problem(s)" in msg


def test_schema_and_file_problems_reported_together(model_dir):
    data = valid()
    data["models"][0]["max_batch_size"] = "big"
    data["models"][1]["versions"][0]["path"] = "models/nope.pt"
    msg = problems(data, model_dir)
    assert "models.0.max_batch_size" in msg
    assert "models.1.versions.0.path" in msg


def test_duplicate_names_reported_with_other_errors(model_dir):
    data = valid()
    data["models"][1]["name"] = "a"
    data["server"]["address"] = "http://x"
    msg = problems(data, model_dir)
    assert "server.address" in msg
    assert "duplicate model name" in msg


def test_union_key_path_is_readable(model_dir):
    data = valid()
    data["workers"]["devices"] = ["cpu", "gpu0"]
    msg = problems(data, model_dir)
    assert "workers.devices.1:" in msg, msg
    assert "literal[" not in msg and "constrained-str" not in msg, msg


def test_parse_non_mapping(model_dir):
    assert "(top level)" in problems(["models"], model_dir)
    assert "(top level)" in problems(None, model_dir)


def test_label_file_is_read_from_model_roots_and_resolved(model_dir):
    (model_dir / "labels.txt").write_text("cat\ndog\n")
    data = valid()
    data["models"][0]["outputs"][0]["labels"] = "labels.txt"
    data["models"][0].update(max_batch_size=0, warmup_batch_sizes=[1])
    cfg = parse_config(data, str(model_dir))
    assert cfg.models[0].outputs[0].labels == str(model_dir / "labels.txt") and not cfg.models[0].batched
    assert cfg.models[0].max_rows == 1
    data["models"][0]["outputs"][0]["labels"] = "/etc/hostname"   # its lines go to clients: confined
    assert "models.0.outputs.0.labels" in problems(data, model_dir)
