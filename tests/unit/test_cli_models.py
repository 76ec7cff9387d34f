"""`tgw-broker models ...` / `reload` without a broker: argument parsing, the VERSION=WEIGHT
parser, the printers, and the query path with `ask` replaced (live-broker tests are in e2e)."""
from __future__ import annotations

import json

import pytest

from tgw.broker.cli import ask as control, main as cli, models as cli_models
from tgw.broker.cli.models import parse_weights
from tgw.shm.errors import VersionNotFoundError
from tgw.shm.wire import (PROTOCOL_VERSION as V, ControlReply, IOSpec, LoadVersion, Metadata, MetadataReply, ModelMetadata, Reload,
                          SetTraffic, Snapshot, Status, StatusReply, UnloadVersion, VersionInfo, encode,
                          request_decoder)

DIGEST = "AB" * 32


def parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


def request_of(*argv: str):
    """The message the verb would send, through the wire codec as the broker would read it."""
    args = parse(*argv)
    return request_decoder.decode(encode(args.request(args)))


def usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# ---- parsing ---------------------------------------------------------------------------------

def test_load_with_every_flag():
    args = parse("models", "load", "mlp", "--version", "3", "--path", "/models/mlp/3.pt", "--sha256", DIGEST,
                 "--weight", "10", "--address", "ipc:///tmp/x.sock", "--json", "--token-file", "/t",
                 "--server-key", "k")
    assert (args.address, args.json, args.token_file, args.server_key) == ("ipc:///tmp/x.sock", True, "/t", "k")
    assert args.label == "tgw-broker models load"
    assert args.request(args) == LoadVersion(v=V, model="mlp", version="3", path="/models/mlp/3.pt",
                                             sha256=DIGEST.lower(), weight=10)


def test_load_defaults_to_a_hot_swap_of_the_declared_path_with_a_long_wait():
    args = parse("models", "load", "mlp", "--version", "3")
    assert args.timeout == 600.0 and not args.json
    assert request_of("models", "load", "mlp", "--version", "3") == LoadVersion(v=V, model="mlp", version="3")


@pytest.mark.parametrize("argv, complaint", [
    (("models", "load", "mlp"), "--version"),
    (("models", "load", "--version", "3"), "NAME"),
    (("models", "load", "mlp", "--version", "3", "--weight", "-1"), "not a non-negative integer"),
    (("models", "load", "mlp", "--version", "3", "--weight", "0.5"), "not a non-negative integer"),
    (("models", "load", "mlp", "--version", "3", "--sha256", "abc"), "not a SHA-256 digest"),
    (("models", "load", "mlp", "--version", "3", "--sha256", "g" * 64), "not a SHA-256 digest"),
    (("models",), "required"),
    (("models", "traffic", "mlp"), "VERSION=WEIGHT"),
])
def test_bad_arguments_are_usage_errors(capsys, argv, complaint):
    assert complaint in usage_error(capsys, *argv)


def test_unload_one_version_or_all():
    assert request_of("models", "unload", "mlp", "--version", "1") == UnloadVersion(v=V, model="mlp", version="1")
    assert request_of("models", "unload", "mlp") == UnloadVersion(v=V, model="mlp")
    assert parse("models", "unload", "mlp").timeout == 600.0


def test_traffic_sends_the_weights():
    assert request_of("models", "traffic", "mlp", "1=90", "2=10") == \
        SetTraffic(v=V, model="mlp", weights={"1": 90, "2": 10})
    assert parse("models", "traffic", "mlp", "1=1").timeout == 60.0


def test_traffic_refuses_a_bad_pair_with_its_reason(capsys):
    err = usage_error(capsys, "models", "traffic", "mlp", "1=90", "1=10")
    assert "tgw-broker models traffic: error: version '1' is given twice" in err


def test_list_metadata_reload_status_snapshot():
    assert request_of("models", "list") == Metadata(v=V)
    assert request_of("models", "metadata", "mlp") == Metadata(v=V, model="mlp")
    assert request_of("models", "metadata") == Metadata(v=V)
    assert request_of("reload") == Reload(v=V)
    assert request_of("status") == Status(v=V)
    assert request_of("snapshot", "--worker", "2") == Snapshot(v=V, worker=2)
    waits = {verb: parse(*verb.split()).timeout for verb in ("models list", "models metadata", "reload", "status",
                                                              "snapshot")}
    assert waits == {"models list": 5.0, "models metadata": 5.0, "reload": 600.0, "status": 5.0, "snapshot": 30.0}
    assert parse("reload").label == "tgw-broker reload"


# ---- VERSION=WEIGHT --------------------------------------------------------------------------

def test_parse_weights():
    assert parse_weights(["1=90", "2=10", "canary-b=0"]) == {"1": 90, "2": 10, "canary-b": 0}


@pytest.mark.parametrize("pairs, reason", [
    (["190"], "'190' is not VERSION=WEIGHT"),
    (["=90"], "'=90' is not VERSION=WEIGHT"),
    (["1="], "'1=': the weight '' is not a non-negative integer"),
    (["1=-5"], "'1=-5': the weight '-5' is not a non-negative integer"),
    (["1=2.5"], "the weight '2.5' is not"),
    (["1=²"], "the weight '²' is not"),
    (["1=x"], "the weight 'x' is not"),
    (["1=1", "2=1", "1=3"], "version '1' is given twice"),
])
def test_parse_weights_names_the_bad_pair(pairs, reason):
    with pytest.raises(ValueError) as exc_info:
        parse_weights(pairs)
    assert reason in str(exc_info.value)


# ---- printers --------------------------------------------------------------------------------

def version(name: str, weight: int, state: str = "ready", **kw) -> VersionInfo:
    return VersionInfo(version=name, path=f"/models/mlp/{name}.pt", state=state, weight=weight, **kw)


def model(versions: list[VersionInfo], name: str = "mlp", default: str | None = "1",
          residency: str = "always") -> ModelMetadata:
    return ModelMetadata(name=name, inputs=[IOSpec(name="x", dtype="float32", shape=[256])],
                         outputs=[IOSpec(name="y", dtype="float32", shape=[-1, 10])], max_batch_size=64,
                         default_version=default, residency=residency, versions=versions)


def test_models_table(capsys):
    reply = MetadataReply(v=V, id=1, models=[
        model([version("1", 90), version("2", 10)]),
        model([version("7", 1), version("8", 2, state="loading"), version("9", 0, state="draining")],
              name="a-long-model-name", default="8", residency="on_demand"),
        model([], name="embed", default=None, residency="on_demand")])
    cli_models.print_models(reply)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["model", "residency", "default", "versions"]
    assert lines[1].split(None, 3) == ["mlp", "always", "1", "1 ready 90%, 2 ready 10%"]
    assert lines[2].split(None, 3) == ["a-long-model-name", "on_demand", "8",
                                       "7 ready 33.3%, 8 loading 66.7%, 9 draining 0%"]
    assert lines[3].split(None, 3) == ["embed", "on_demand", "-", "none loaded"]
    residency_columns = {line.index(word) for line, word in zip(lines, ("residency", "always", "on_demand", "on_"))}
    assert len(residency_columns) == 1


def test_metadata(capsys):
    reply = MetadataReply(v=V, id=1, models=[model([
        version("1", 3, sha256="ab" * 32, workers={"worker0[cpu]": "loaded", "worker1[cpu]": "unloading"},
                bytes=3 * 2**20, loads=2, evictions=1, last_load_ms=812.4),
        version("2", 1, state="loading", workers={"worker0[cpu]": "loading"}, format="export")])])
    cli_models.print_metadata(reply)
    assert capsys.readouterr().out.splitlines() == [
        "mlp: always, default version 1, max batch 64",
        "  input  x float32 [256]",
        "  output y float32 [-1, 10]",
        "  version 1: ready, weight 3 (75%), 3.0 MiB, loads 2, evictions 1, last load 812 ms",
        f"    path /models/mlp/1.pt (torchscript), sha256 {'ab' * 32}",
        "    worker0[cpu] loaded, worker1[cpu] unloading",
        "  version 2: loading, weight 1 (25%), 0.0 MiB, loads 0, evictions 0, last load 0 ms",
        "    path /models/mlp/2.pt (export)",
        "    worker0[cpu] loading",
    ]


def test_control_reply_message_figures_events_and_model(capsys):
    load = {"seq": 4, "at_s": 12.25, "event": "load", "model": "mlp", "version": "2", "worker": "worker0[cpu]",
            "ms": 812.4, "bytes": 2 * 2**20, "rss_before": 100 * 2**20, "rss_after": 102 * 2**20}
    reply = ControlReply(v=V, id=1, message="mlp:2 serves every request that names no version; 1 drained and unloaded",
                         model=model([version("2", 100)], default="2"),
                         details={"workers": {"worker0[cpu]": {"load_ms": 812.4, "bytes": 2 * 2**20}},
                                  "drained": 3, "unloaded": ["1"], "swap": True, "freed": {"rss_bytes": 2**20},
                                  "events": [load, {"at_s": 13.0, "event": "unload", "model": "mlp", "version": "1",
                                                    "worker": "worker0[cpu]", "bytes": 2**20}]})
    cli_models.print_control(reply)
    assert capsys.readouterr().out.splitlines() == [
        "mlp:2 serves every request that names no version; 1 drained and unloaded",
        "  workers worker0[cpu]: load_ms 812 ms, bytes 2.0 MiB",
        "  drained 3",
        "  unloaded 1",
        "  swap True",
        "  freed: rss_bytes 1.0 MiB",
        "  at 12.2 s load mlp:2 on worker0[cpu], 812 ms, 2.0 MiB, RSS 100 -> 102 MiB",
        "  at 13.0 s unload mlp:1 on worker0[cpu], 1.0 MiB",
        "  mlp now: 2 ready 100%",
    ]


def test_control_reply_without_model(capsys):
    cli_models.print_control(ControlReply(v=V, id=1, message="config reloaded: nothing changed"))
    assert capsys.readouterr().out == "config reloaded: nothing changed\n"


def status_reply(**kw) -> StatusReply:
    return StatusReply(v=V, id=1, phase="serving", uptime_s=42.0, workers=[], models={}, **kw)


def test_status_shows_the_last_reload_and_recent_events(capsys):
    events = [{"at_s": float(i), "event": "traffic", "model": "mlp", "message": f"e{i}"} for i in range(7)]
    events.append({"at_s": 40.25, "event": "load", "model": "mlp", "version": "2", "worker": "worker0[cpu]",
                   "ms": 812.4, "bytes": 2 * 2**20, "message": "warm"})
    cli.print_status("ipc:///tmp/x.sock", status_reply(
        reload={"path": "/etc/tgw.yaml", "at_s": 30.5, "ok": False, "message": "server.address needs a restart"},
        events=events))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "ipc:///tmp/x.sock: serving, up 42 s"
    tail = out[out.index("config: /etc/tgw.yaml, last reload FAILED at 30.5 s: server.address needs a restart"):]
    assert tail[1:] == ["recent model events:", "  at 3.0 s traffic mlp: e3", "  at 4.0 s traffic mlp: e4",
                        "  at 5.0 s traffic mlp: e5", "  at 6.0 s traffic mlp: e6",
                        "  at 40.2 s load mlp:2 on worker0[cpu], 812 ms, 2.0 MiB: warm"]


def test_status_reload_line_variants():
    assert cli.reload_line({"path": "/etc/tgw.yaml"}) == "config: /etc/tgw.yaml"
    assert cli.reload_line({"path": "/etc/tgw.yaml", "at_s": 3.0, "ok": True, "message": ""}) == \
        "config: /etc/tgw.yaml, last reload OK at 3.0 s"
    assert cli_models.event_line({"at_s": 1.0, "event": "evict", "model": "big", "version": "1"}) == \
        "at 1.0 s evict big:1"
    assert cli_models.event_line({"at_s": 2.0, "event": "load_failed", "model": "big", "version": "2",
                                  "worker": "worker1[cpu]", "reason": "checksum", "message": "sha256 differs"}) == \
        "at 2.0 s load_failed big:2 on worker1[cpu] (checksum): sha256 differs"
    replayed = {"rounds": 3, "covered": [{"rows": 4, "shapes": [[16]]}], "p99_ms": [201.5, 0.4, 0.41],
                "settled": True, "seconds": 0.62}
    assert cli_models.event_line({"at_s": 3.0, "event": "load", "model": "big", "version": "3", "ms": 700.0,
                                  "replay": replayed}) == ("at 3.0 s load big:3, 700 ms, replay warm-up: 3 round(s) "
                                                           "of 1 batch(es), p99 201.5 -> 0.4 -> 0.41 ms, settled in "
                                                           "0.62 s")


def test_status_without_reload_or_events_prints_neither(capsys):
    cli.print_status("ipc:///tmp/x.sock", status_reply())
    out = capsys.readouterr().out
    assert "config:" not in out and "events" not in out


# ---- the query path, with `ask` replaced -----------------------------------------------------

@pytest.fixture
def answers(monkeypatch):
    """Replace control.ask: record what was sent and answer the reply (or raise the error) set."""
    sent, answer = [], {}

    def fake_ask(address, msg, timeout_s, *, token=None, server_key=None):
        sent.append((address, msg, timeout_s))
        if isinstance(answer["reply"], Exception):
            raise answer["reply"]
        return answer["reply"]

    monkeypatch.setattr(control, "ask", fake_ask)
    monkeypatch.delenv("TGW_TOKEN", raising=False)
    return sent, answer


def run_main(*argv: str) -> int:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(list(argv))
    return exit_info.value.code


def test_query_prints_the_reply(answers, capsys):
    sent, answer = answers
    answer["reply"] = ControlReply(v=V, id=2, message="traffic of mlp set", model=model([version("1", 1)]))
    assert run_main("models", "traffic", "mlp", "1=1", "--address", "ipc:///tmp/x.sock") == 0
    assert sent == [("ipc:///tmp/x.sock", SetTraffic(v=V, model="mlp", weights={"1": 1}), 60.0)]
    assert capsys.readouterr().out == "traffic of mlp set\n  mlp now: 1 ready 100%\n"


def test_query_json(answers, capsys):
    _, answer = answers
    answer["reply"] = MetadataReply(v=V, id=2, models=[model([version("1", 1)])])
    assert run_main("models", "metadata", "mlp", "--json", "--address", "ipc:///tmp/x.sock") == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["op"] == "metadata" and printed["models"][0]["versions"][0]["version"] == "1"


def test_query_error_exits_1_naming_the_verb(answers, capsys):
    _, answer = answers
    answer["reply"] = VersionNotFoundError("model mlp has no version 9")
    assert run_main("models", "unload", "mlp", "--version", "9", "--address", "ipc:///tmp/x.sock") == 1
    assert capsys.readouterr().err == "tgw-broker models unload: VERSION_NOT_FOUND: model mlp has no version 9\n"


def test_unreachable_broker_exits_1(capsys, tmp_path):
    assert run_main("models", "load", "mlp", "--version", "2", "--address", f"ipc://{tmp_path}/none.sock") == 1
    assert capsys.readouterr().err.startswith("tgw-broker models load: no tgw broker at ipc://")
