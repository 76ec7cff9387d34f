"""The CLI without surprises (issue 39), without a broker: relative `models load` paths taken from
the current directory, `--config` naming the broker a verb asks, the load's progress lines, and
`check-config --load`'s report lines. Live brokers: tests/process/test_model_ops.py
(test_cli_verbs_against_a_running_broker), tests/process/test_check_config.py, the closed pipe
in tests/process/test_cli_errors.py."""
from __future__ import annotations

import os

import pytest
import yaml

from config_cases import make_model_dir, valid, write
from conftest import wait_until
from tgw.broker.cli import check_load, connect, load_progress, main as cli
from tgw.broker.config.load import load_config
from tgw.broker.front.auth import keygen


def parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


# ---- relative paths --------------------------------------------------------------------------

def test_relative_load_paths_are_taken_from_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    here = os.getcwd()

    def sent(*flags: str):
        args = parse("models", "load", "m", "--version", "2", *flags)
        return args.request(args)
    assert sent("--path", "models/m2.pt").path == os.path.join(here, "models/m2.pt")
    assert sent("--path", "../m2.pt").path == os.path.join(here, "../m2.pt")   # the broker refuses the '..'
    assert sent("--path", "/abs/m2.pt").path == "/abs/m2.pt"
    assert sent("--handler", "stages/s.py:Upper").handler == os.path.join(here, "stages/s.py") + ":Upper"
    assert sent("--handler", "/abs/s.py:Upper").handler == "/abs/s.py:Upper"
    assert sent("--handler", "tgw.workers.demo_stages:TopK").handler == "tgw.workers.demo_stages:TopK"
    assert sent().path is None and sent().handler is None


# ---- --config --------------------------------------------------------------------------------

@pytest.fixture
def config_file(tmp_path, monkeypatch):
    """A valid config naming an address, a token file and a CURVE key pair; no $TGW_* set."""
    for name in ("TGW_ADDRESS", "TGW_TOKEN", "TGW_SERVER_KEY"):
        monkeypatch.delenv(name, raising=False)
    base = make_model_dir(tmp_path)
    (base / "token").write_text("s3cret\n")
    (base / "token").chmod(0o600)
    public, secret = keygen(str(base / "keys"))
    data = valid()
    data["server"].update(address="tcp://127.0.0.1:7555", auth_token_file="token", curve_secret_key_file=secret)
    return write(base, yaml.safe_dump(data)), public, secret


def test_config_gives_the_address_token_and_public_key(config_file):
    path, public, _ = config_file
    to = connect.resolve(parse("status", "--config", path))
    assert to == connect.Connection("tcp://127.0.0.1:7555", "s3cret", public)


def test_flags_beside_config_win(config_file, tmp_path):
    path, _, _ = config_file
    (tmp_path / "other-token").write_text("other")
    to = connect.resolve(parse("models", "list", "--config", path, "--address", "ipc:///tmp/x.sock",
                               "--token-file", str(tmp_path / "other-token"), "--server-key", "K" * 40))
    assert to == connect.Connection("ipc:///tmp/x.sock", "other", "K" * 40)


def test_the_secret_key_file_serves_when_no_public_one_is_beside_it(config_file):
    path, public, secret = config_file
    os.unlink(public)
    assert connect.resolve(parse("status", "--config", path)).server_key == secret


def test_every_broker_verb_takes_config():
    for argv in (["status"], ["snapshot"], ["metrics"], ["reload"], ["models", "list"], ["models", "diff", "m"],
                 ["models", "load", "m", "--version", "2"], ["models", "unload", "m"], ["models", "metadata"],
                 ["models", "traffic", "m", "1=1"]):
        assert parse(*argv, "--config", "c.yaml").config == "c.yaml", argv


def test_a_bad_config_is_one_line_naming_it(tmp_path, capsys):
    assert cli.query(parse("status", "--config", str(tmp_path / "none.yaml"))) == 1
    err = capsys.readouterr().err
    assert err.startswith("tgw-broker status: --config: cannot read config") and "Traceback" not in err


# ---- models load's progress ------------------------------------------------------------------

def test_phase_lines_are_new_phases_of_the_version_only():
    seen: set = set()
    loading = [{"version": "2", "worker": "worker0[cpu]", "phase": "loading", "seconds": 0.31},
               {"version": "1", "worker": "worker0[cpu]", "phase": "warming", "seconds": 9.0}]
    assert load_progress.phase_lines("m", "2", loading, seen) == ["m:2 loading on worker0[cpu] (0.3 s)"]
    assert load_progress.phase_lines("m", "2", loading, seen) == []          # said once
    loading[0].update(phase="warming", seconds=1.25)
    assert load_progress.phase_lines("m", "2", loading, seen) == ["m:2 warming on worker0[cpu] (1.2 s)"]
    assert load_progress.ready_line("m", "2", 4.12) == "m:2 ready after 4.1 s"
    assert load_progress.ready_line("m", "2", 0.012) == "m:2 ready after 12 ms"


class Statuses:
    """status() answers: each reply's models once (None: the status fails), then the last one again."""

    def __init__(self, *models: dict):
        self.replies = list(models)

    def __call__(self):
        models = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        if models is None:
            raise ConnectionError("no answer")
        return type("StatusReply", (), {"models": models})()


def test_watch_prints_each_phase_then_ready(monkeypatch):
    monkeypatch.setattr(load_progress, "POLL_S", 0.001)
    said: list[str] = []
    entry = {"version": "2", "worker": "w0", "seconds": 0.0}
    statuses = Statuses({"m": {"loading": [{**entry, "phase": "loading"}]}}, None,   # a failed status: skipped
                        {"m": {"loading": [{**entry, "phase": "warming"}]}})
    with load_progress.Watch("m", "2", statuses, said.append):
        wait_until(lambda: len(said) >= 2, what="both phases shown while the request is pending")
    assert said[:2] == ["m:2 loading on w0 (0.0 s)", "m:2 warming on w0 (0.0 s)"]
    assert said[2].startswith("m:2 ready after ") and len(said) == 3


def test_watch_without_loading_in_status_says_only_ready_and_nothing_on_failure():
    said: list[str] = []
    with load_progress.Watch("m", "2", Statuses({"m": {"ready": True}}), said.append):
        pass
    assert len(said) == 1 and said[0].startswith("m:2 ready after ")
    said.clear()
    with pytest.raises(RuntimeError):
        with load_progress.Watch("m", "2", Statuses({}), said.append):
            raise RuntimeError("the load failed")
    assert said == []


def test_progress_only_on_a_terminal_and_not_with_json():
    class Tty:
        def __init__(self, tty: bool):
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty
    load = parse("models", "load", "m", "--version", "2")
    assert load_progress.wanted(load, Tty(True)) and not load_progress.wanted(load, Tty(False))
    assert not load_progress.wanted(parse("models", "load", "m", "--version", "2", "--json"), Tty(True))
    assert load.progress is load_progress.watch and getattr(parse("status"), "progress", None) is None


# ---- check-config --load's lines -------------------------------------------------------------

def test_check_load_lines():
    assert check_load.outcome({"ok": True, "seconds": 1.23, "bytes": 45 * 2**20}) == "ok (load 1.2 s, 45.0 MiB)"
    assert check_load.outcome({"ok": True, "seconds": 0.008, "bytes": 0}) == "ok (load 8 ms)"
    assert check_load.outcome({"ok": True, "seconds": 0.5, "bytes": 3000}) == "ok (load 500 ms, 2.9 KiB)"
    assert check_load.outcome({"ok": False, "error": "RuntimeError: a\nb\n"}) == "FAILED: RuntimeError: a\n    b"
    assert check_load.exit_text(-11) == "signal 11" and check_load.exit_text(3) == "exit 3"


def test_check_load_asks_for_every_version_of_every_model(tmp_path):
    cfg = load_config(write(make_model_dir(tmp_path), yaml.safe_dump(valid())))
    specs = check_load.specs_of(cfg)
    assert [(s["name"], s["version"]) for s in specs] == [(m.name, v.version) for m in cfg.models for v in m.versions]
    assert all(os.path.isabs(s["path"]) for s in specs)
    assert check_load.first_device(cfg) == "cpu"
