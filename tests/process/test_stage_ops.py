"""Stage versions at run time against a real broker (one for the module): `models load` of a
stage version names a handler class (native op, CLI, HTTP repository), swaps under traffic with
no failed request or canaries by weight as a model's version does; handlers outside
model_roots, a path for a stage and a handler for a model are refused with their cause; a
reload refuses a stage version whose options or handler file changed and loads new versions
with new options.

Stage "text" version 1 is tests/stages.py's RowFails (each element back), the loads bring
Upper (upper-cased), so every answer names the version that computed it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request

import pytest
import yaml

import stages
from tgw.testing.lifecycle import control, model_decl, save_add_model
from conftest import served, wait_until
from tgw.testing.child import BrokerProc
from tgw.client import Client
from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import LoadVersion, Reload, UnloadVersion


def config(root: str, text_versions: list[dict], tagged_versions: list[dict], tag: str) -> dict:
    return {"model_roots": [root], "http": {"port": 0},
            "workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 4, "output_arena_mb": 2},
            "models": [model_decl("m", [("1", os.path.join(root, "models", "add1.pt"))]),
                       stages.stage_entry("stages/stages.py", "Upper", name="text", versions=text_versions),
                       stages.stage_entry("stages/tagged.py", "Tagged", versions=tagged_versions,
                                          options={"tag": tag})]}


@pytest.fixture(scope="module")
def broker():
    d = tempfile.mkdtemp(prefix="tgwso-", dir="/tmp")   # ipc paths must stay short
    for sub in ("stages", "models"):
        os.makedirs(os.path.join(d, sub))
    shutil.copy(stages.__file__, os.path.join(d, "stages", "stages.py"))
    shutil.copy(stages.__file__, os.path.join(d, "stages", "tagged.py"))   # a file of its own: edited below
    save_add_model(os.path.join(d, "models", "add1.pt"), 1)
    yield from served(config(d, [{"version": "1", "handler": "stages/stages.py:RowFails"}],
                             [{"version": "1", "handler": "stages/tagged.py:Tagged"}], "-a"), d, http=True,
                      root=os.path.realpath(d))


def handler(b: BrokerProc, cls: str, file: str = "stages.py") -> str:
    return f"{b.root}/stages/{file}:{cls}"


def answer(b: BrokerProc, model: str = "text", data: bytes = b"abc", **kw) -> list[bytes]:
    with Client(b.address) as c:
        return [bytes(v) for v in c.infer(model, {"data": [data]}, timeout=30, **kw)["data"].ravel()]


def versions(b: BrokerProc, model: str) -> list[tuple[str, str]]:
    with Client(b.address) as c:
        return [(v["version"], v["state"]) for v in c.metadata(model)[0]["versions"]]


def test_a_stage_version_hot_swaps_under_traffic_with_no_failure(broker):
    stop, swapped = threading.Event(), threading.Event()
    seen: list[list[tuple[bool, bytes]]] = [[], []]   # per caller: (sent after the swap answered, answer)
    errors: list[str] = []

    def caller(i: int) -> None:
        with Client(broker.address) as c:
            while not stop.is_set():
                after = swapped.is_set()
                try:
                    out = c.infer("text", {"data": [b"abc"]}, timeout=30)["data"]
                except TgwError as err:
                    errors.append(f"{err.code.value}: {err.message}")
                    continue
                seen[i].append((after, bytes(out.ravel()[0])))
    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: all(len(s) >= 20 for s in seen), 60, "20 answers per caller from version 1")
        reply = control(broker.address, LoadVersion(v=0, model="text", version="2", handler=handler(broker, "Upper")))
        swapped.set()
        marks = [len(s) for s in seen]
        wait_until(lambda: all(len(s) >= m + 20 for s, m in zip(seen, marks)), 60, "20 answers per caller after")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert errors == [], errors[:5]
    assert "text:2 serves every request" in reply.message and "1 drained and unloaded" in reply.message, reply.message
    for answers in seen:
        got = [a for _, a in answers]
        assert set(got) == {b"abc", b"ABC"}, set(got)
        assert got == sorted(got, key=lambda a: a == b"ABC"), "a caller went back to version 1"
        assert all(a == b"ABC" for after, a in answers if after)
    assert versions(broker, "text") == [("2", "ready")]
    with Client(broker.address) as c:
        assert c.metadata("text")[0]["versions"][0]["path"] == handler(broker, "Upper")


def test_a_canary_stage_version_by_weight_from_the_cli_and_over_http(broker):
    r = subprocess.run([sys.executable, "-m", "tgw.broker", "models", "load", "text", "--version", "3",
                        "--handler", handler(broker, "RowFails"), "--weight", "0", "--address", broker.address],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "text:3 loaded with weight 0" in r.stdout, r.stdout + r.stderr
    assert answer(broker, version="3") == [b"abc"] and answer(broker) == [b"ABC"]   # only when named
    body = json.dumps({"parameters": {"version": "4", "handler": handler(broker, "RowFails"), "weight": 0}})
    req = urllib.request.Request(f"{broker.http}/v2/repository/models/text/load", data=body.encode(), method="POST")
    with urllib.request.urlopen(req, timeout=120) as got:
        assert got.status == 200 and "text:4 loaded with weight 0" in json.loads(got.read())["message"]
    assert answer(broker, version="4") == [b"abc"]
    for v in ("3", "4"):
        control(broker.address, UnloadVersion(v=0, model="text", version=v))
    assert versions(broker, "text") == [("2", "ready")]


def test_refused_stage_loads_name_their_cause_and_change_nothing(broker, tmp_path):
    outside = tmp_path / "outside.py"
    shutil.copy(stages.__file__, outside)
    stage_file = f"{broker.root}/stages/stages.py"
    cases = [
        (dict(model="text", handler=f"{outside}:Upper"), "outside_model_roots", "is outside model_roots"),
        (dict(model="text", handler="stages/stages.py:Upper"), "outside_model_roots", "must be absolute"),
        (dict(model="text", handler=f"{broker.root}/stages/../stages/stages.py:Upper"), "outside_model_roots",
         "'..'"),
        (dict(model="text", path=stage_file), "wrong_source", "'text' is a stage"),
        (dict(model="m", handler=handler(broker, "Upper")), "wrong_source", "'m' is a model"),
        (dict(model="text", handler=handler(broker, "Nope")), "file", "defines no 'Nope'"),
        (dict(model="text", handler=f"{broker.root}/stages/missing.py:Upper"), "file", "handler file not found"),
        (dict(model="text", handler=handler(broker, "Upper"), sha256="0" * 64), "checksum", "sha256 does not match"),
        (dict(model="text"), "no_path", "give its handler"),
    ]
    for fields, reason, words in cases:
        with pytest.raises(TgwError) as info:
            control(broker.address, LoadVersion(v=0, version="9", **fields))
        err = info.value
        assert err.code is Code.INVALID_ARGUMENT and words in err.message, (fields, err)
        assert err.details.get("reason") == reason, (fields, err.details)
    with pytest.raises(TgwError) as info:   # the schema's rules too, named
        control(broker.address, LoadVersion(v=0, model="text", version="9", handler=handler(broker, "Upper"),
                                            format="torchscript"))
    assert info.value.code is Code.INVALID_ARGUMENT and "a handler is a stage" in info.value.message
    assert versions(broker, "text") == [("2", "ready")] and answer(broker) == [b"ABC"]


def test_a_reload_refuses_changed_options_or_handler_file_of_a_served_version_and_loads_new_ones(broker):
    with Client(broker.address) as c:   # "text" as it serves now, so the reloads leave it alone
        text = [{"version": v["version"], "handler": v["path"]} for v in c.metadata("text")[0]["versions"]]

    def reload(tagged: list[dict], tag: str):
        with open(broker.config_path, "w") as f:
            yaml.safe_dump(config(broker.root, text, tagged, tag), f)
        return control(broker.address, Reload(v=0))

    def tagged() -> tuple[list[bytes], list[bytes]]:
        with Client(broker.address) as c:
            out = c.infer("tagged", {"data": [b"x"]}, timeout=30)
        return [bytes(v) for v in out["data"].ravel()], [bytes(v) for v in out["context"].ravel()]

    assert tagged()[0] == [b"x-a"]
    v1, v2 = [{"version": "1", "handler": "stages/tagged.py:Tagged"}], [{"version": "2",
                                                                        "handler": "stages/tagged.py:Tagged"}]
    with pytest.raises(TgwError) as info:    # version 1 kept: it would run with options it was not loaded with
        reload(v1, "-b")
    assert info.value.code is Code.INVALID_ARGUMENT and info.value.details["reason"] == "needs_restart"
    assert "models.tagged.options (versions ['1']" in info.value.message and "nothing changed" in info.value.message
    assert tagged()[0] == [b"x-a"]

    reply = reload(v2, "-b")                 # a new version with the new options: 1 drains
    assert "tagged:2" in reply.message and "tagged:1" in reply.message, reply.message
    assert tagged() == ([b"x-b"], [b"tagged|2|stages|cpu|1|warmed=True"])
    assert versions(broker, "tagged") == [("2", "ready")]

    with open(os.path.join(broker.root, "stages", "tagged.py"), "a") as f:
        f.write("\n# edited: new code for version 2\n")
    with pytest.raises(TgwError) as info:    # the same config, but version 2's handler file changed
        reload(v2, "-b")
    assert "models.tagged.versions.2 (handler, sha256 or the handler file's content" in info.value.message
    assert tagged()[0] == [b"x-b"] and versions(broker, "tagged") == [("2", "ready")]
