"""Triton's load with a config override and files (protocol/uploads.py): the parameters read as
both faces send them, every path that could leave the model's folder refused, the files written
into a fresh folder under the first model root, and the load refused while the switch is off."""
from __future__ import annotations

import asyncio
import base64
import os

import pytest

from tgw.broker.protocol import uploads
from tgw.broker.protocol.repository import Repository
from tgw.shm.errors import TgwError


def test_config_and_files_split_from_the_other_parameters():
    assert uploads.split("m", {"version": "2"}) == (None, {"version": "2"})
    upload, rest = uploads.split("m", {"config": "{}", "file:1/model.pt": base64.b64encode(b"\x00pt").decode(),
                                       "file:labels.txt": b"a\nb\n", "unload_dependents": False})
    assert upload == uploads.Upload("{}", {"1/model.pt": b"\x00pt", "labels.txt": b"a\nb\n"})
    assert rest == {"unload_dependents": False}
    with pytest.raises(TgwError, match="'file:1/m.pt' is not base64"):
        uploads.split("m", {"file:1/m.pt": "not base64!"})
    with pytest.raises(TgwError, match="config must be the model config as JSON text"):
        uploads.split("m", {"config": 3})


@pytest.mark.parametrize("path", ["../x", "1/../../x", "/etc/passwd", "", "1//m.pt", "./1/m.pt", "1/.", "a\\\\b",
                                  "1/m.pt/", "x\0y"])
def test_every_path_that_could_leave_the_folder_is_refused(path):
    with pytest.raises(TgwError) as info:
        uploads.split("m", {"config": "{}", f"file:{path}": b""})
    assert info.value.message.startswith("failed to load 'm', parameter") and "without '..'" in info.value.message
    assert info.value.details["reason"] == "load_refused"


def test_files_form_a_fresh_folder_under_the_first_root(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    up = uploads.Uploads(str(root))
    one = up.write("net", {"1/model.pt": b"a", "2/model.pt": b"b", "config.pbtxt": b""})
    two = up.write("net", {"1/model.pt": b"c"})
    assert one == str(root / "uploads" / "net.1" / "net") and two == str(root / "uploads" / "net.2" / "net")
    assert (root / "uploads" / "net.1" / "net" / "2" / "model.pt").read_bytes() == b"b"
    assert (root / "uploads" / "net.2" / "net" / "1" / "model.pt").read_bytes() == b"c"
    with pytest.raises(TgwError, match="cannot write its files"):   # a file where a folder must be
        up.write("net", {"1": b"x", "1/model.pt": b"y"})
    assert not (root / "uploads" / "net.3").exists()   # a failed write leaves nothing
    for bad in ("../x", ".hidden", "a/b", ""):
        with pytest.raises(TgwError, match="needs a name of letters"):
            up.write(bad, {"1/model.pt": b""})
    assert sorted(os.listdir(root / "uploads")) == ["net.1", "net.2"]
    assert uploads.model_folder("net", [one + "/1/model.pt", one + "/2/model.pt"]) == one
    assert up.folder_of([one + "/1/model.pt", one + "/2/model.pt"]) == one
    assert up.folder_of([str(tmp_path / "net.pt")]) is None and up.folder_of([None]) is None
    up.discard(two)
    up.discard(str(tmp_path / "root"))   # not an uploaded model folder: left alone
    assert sorted(os.listdir(root / "uploads")) == ["net.1"] and root.is_dir()
    with pytest.raises(TgwError, match="needs a model from a Triton repository"):
        uploads.model_folder("net", [str(tmp_path / "net.pt")])


def test_a_load_with_a_config_is_refused_while_the_switch_is_off(tmp_path):
    def ask(msg):
        raise AssertionError("nothing may reach the operator")
    for switch, token in ((None, "t"), (uploads.Uploads(str(tmp_path)), None)):
        repo = Repository(None, None, ask, token=token, uploads=switch)
        for params in ({"config": "{}"}, {"config": "{}", "file:1/model.pt": "AA=="}):
            with pytest.raises(TgwError) as info:
                asyncio.run(repo.load_model("m", params))
            assert info.value.details["reason"] == "model_uploads_disabled", info.value
            assert info.value.message.startswith("failed to load 'm', ") and "allow_model_uploads" in \
                info.value.message
    assert not os.path.exists(tmp_path / "uploads")
    repo = Repository(None, None, ask, token="t", uploads=uploads.Uploads(str(tmp_path)))
    with pytest.raises(TgwError, match="failed to load 'm', failed to poll from model repository: files sent "
                                       "without a config"):
        asyncio.run(repo.load_model("m", {"file:1/model.pt": "AA=="}))
    with pytest.raises(TgwError, match=r"parameters \['path'\] go with a load"):
        asyncio.run(repo.load_model("m", {"config": "{}", "path": "/x"}))


def test_the_switch_needs_the_token():
    from pydantic import ValidationError

    from tgw.broker.config.load import ServerDecl
    with pytest.raises(ValidationError, match="allow_model_uploads needs server.auth_token_file"):
        ServerDecl(allow_model_uploads=True)
    assert ServerDecl(allow_model_uploads=True, auth_token_file="/t").allow_model_uploads


def test_a_stages_handler_file_places_its_model_folder():
    from types import SimpleNamespace as V
    versions = [V(path=None, handler="/repo/pre/1/model.py:TritonPythonModel"), V(path="/repo/pre/2/model.pt",
                                                                                    handler=None)]
    assert uploads.version_files(versions) == ["/repo/pre/1/model.py", "/repo/pre/2/model.pt"]
    assert uploads.model_folder("pre", uploads.version_files(versions)) == "/repo/pre"
    with pytest.raises(TgwError, match="needs a model from a Triton repository"):   # a module's class
        uploads.model_folder("pre", uploads.version_files([V(path=None, handler="pkg.mod:Cls")]))
