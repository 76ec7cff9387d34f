"""Config validation (broker/config/load.py): every refusal is a ConfigError naming its key path;
`tgw-broker check-config` runs the same validation."""
from __future__ import annotations

import copy
import hashlib
import os
import subprocess
import sys

import pytest
import yaml

from conftest import unloaded_model
from tgw.broker.config.load import Config, ConfigError, file_sha256, load_config, parse_config



@pytest.fixture
def model_dir(tmp_path):
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


def _weights(*weights):
    """Weights on model a's versions (default_version dropped: the two are exclusive)."""
    def mutate(d):
        d["models"][0].pop("default_version")
        for v, w in zip(d["models"][0]["versions"], weights):
            v["weight"] = w
    return mutate


# (id, mutation, key path that must be named, fragment of the message)
CASES = [
    ("unknown_top", _set("bogus", 1), "bogus", "unknown key"),
    ("unknown_model_key", _set("models.0.batching", {"max_delay_us": 100}), "models.0.batching", "unknown key"),
    ("unknown_server_key", _set("server.port", 80), "server.port", "unknown key"),
    ("unknown_tensor_key", _set("models.1.inputs.0.layout", "nchw"), "models.1.inputs.0.layout", "unknown key"),
    ("wrong_type_int", _set("models.0.max_batch_size", "big"), "models.0.max_batch_size", "integer"),
    ("wrong_type_list", _set("models.0.versions", "1"), "models.0.versions", "list"),
    ("wrong_type_shape", _set("models.0.inputs.0.shape", "4"), "models.0.inputs.0.shape", "list"),
    ("batch_too_big", _set("models.0.max_batch_size", 0), "models.0.max_batch_size", "greater than"),
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
    ("weights_sum_zero", _weights(0, 0), "models.0", "weights of model 'a' sum to 0: at least one version needs"),
    ("weight_and_default", _set("models.0.versions.1.weight", 1), "models.0",
     "default_version and per-version weight are exclusive: requests that name no version follow the weights"),
    ("weight_negative", _weights(-1, 1), "models.0.versions.0.weight", "greater than or equal to 0"),
    ("weight_too_big", _weights(1, 1_000_001), "models.0.versions.1.weight", "less than or equal to 1000000"),
    ("weight_float", _weights(0.5, 1), "models.0.versions.0.weight", "integer"),
    ("residency", _set("models.0.residency", "sometimes"), "models.0.residency", "'always' or 'on_demand'"),
    ("model_roots_string", _set("model_roots", "models"), "model_roots", "list"),
    ("model_roots_empty_entry", _set("model_roots", [""]), "model_roots.0", "at least 1 character"),
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
    _weights(*weights)(data)
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


# ---- load_config: files ------------------------------------------------------------------------

def write(model_dir, text: str) -> str:
    path = model_dir / "tgw.yaml"
    path.write_text(text)
    return str(path)


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


# ---- the CLI -----------------------------------------------------------------------------------

def check_config(path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tgw.broker", "check-config", path],
                          capture_output=True, text=True, timeout=60)


def test_cli_check_config(model_dir):
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
