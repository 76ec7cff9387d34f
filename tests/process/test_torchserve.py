"""TorchServe archives served as they are, by a real broker (one for the module) over a model
store of archives the real `torch-model-archiver` made at test time (tgw.testing.mar_archives):
TorchServe's built-in `text_classifier` (an eager model, source_vocab.pt, index_to_name.json) and
a custom `BaseHandler` subclass decoding images with Pillow. Each answer of `/predictions` is
compared byte for byte with what TorchServe's own Python worker makes of the same request (the
`ts` package's TsModelLoader, Service.predict and its response frame, run here in the test); the
management API lists, describes, registers, sets the default version and unregisters; errors and
the token answer in TorchServe's shape and status."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tgw.client import Client
from tgw.testing import mar_archives as mar
from tgw.testing.child import BrokerProc

pytest.importorskip("ts", reason="the torchserve extra (the ts package) is not installed")
TOKEN = "ts-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def archive_v2(store: str, work: str) -> str:
    """imgclf version 2.0 as the real archiver makes it, as imgclf-v2.mar in `store`: other weights,
    and a handler file of the same name that answers the top 2 (the worker holds both versions)."""
    src = os.path.dirname(mar.image_archive(work, seed=1))
    src = os.path.join(src, ".imgclf-src")
    with open(os.path.join(src, "image_handler.py")) as f:
        code = f.read()
    assert "topk = 3" in code
    with open(os.path.join(src, "image_handler.py"), "w") as f:
        f.write(code.replace("topk = 3", "topk = 2"))
    subprocess.run([mar.archiver(), "--model-name", "imgclf", "--version", "2.0", "--serialized-file", "model.pt",
                    "--handler", "image_handler.py", "--extra-files", "index_to_name.json", "--export-path", work,
                    "--force"], cwd=src, check=True, capture_output=True)
    path = os.path.join(store, "imgclf-v2.mar")
    shutil.copy(os.path.join(work, "imgclf.mar"), path)
    return path


def torchserve_answer(mar_path: str, requests_: list[dict], batch_size: int = 1) -> list[tuple[int, bytes]]:
    """What TorchServe's Python worker answers these requests (each: params [(name, type, bytes)],
    headers {}): its loader and Service.predict on the archive unpacked here, its frame parsed."""
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
    from ts.model_loader import TsModelLoader
    import ts
    folder = mar_path + ".oracle"
    if not os.path.exists(folder):
        with zipfile.ZipFile(mar_path) as z:
            z.extractall(folder)
    manifest = json.load(open(os.path.join(folder, "MAR-INF", "MANIFEST.json")))
    metrics = MetricsCacheYamlImpl(os.path.join(os.path.dirname(ts.__file__), "configs", "metrics.yaml"))
    metrics.initialize_cache()
    sys.path.insert(0, folder)
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        for mod in ("image_handler", "model"):   # each archive imports its own
            sys.modules.pop(mod, None)
        service = TsModelLoader().load(manifest["model"]["modelName"], folder, manifest["model"]["handler"], None,
                                       batch_size, None, True, metrics)
        service.set_cl_socket(None)
        batch = [{"requestId": str(i).encode(),
                  "parameters": [{"name": n, "contentType": t, "value": _value(t, v)} for n, t, v in r["params"]],
                  "headers": [{"name": k.encode(), "value": v.encode()} for k, v in r.get("headers", {}).items()]}
                 for i, r in enumerate(requests_)]
        frame = service.predict(batch)
    finally:
        os.chdir(cwd)
        sys.path.remove(folder)
    return parse_frame(frame)


def _value(content_type: str, value: bytes):
    return value.decode() if content_type.startswith("text") else value   # as TorchServe's worker decodes


def parse_frame(frame: bytes) -> list[tuple[int, bytes]]:
    """(status, body) per request of TorchServe's predict response frame (otf_message_handler)."""
    view, at = memoryview(frame), 0

    def i() -> int:
        nonlocal at
        at += 4
        return struct.unpack("!i", view[at - 4:at])[0]

    def s() -> bytes:
        nonlocal at
        n = i()
        at += n
        return bytes(view[at - n:at])
    i(), s()   # batch code and message
    out = []
    while (n := i()) != -1:
        at += n           # request id
        s()               # content type
        code = i()
        s()               # phrase
        for _ in range(i()):
            s(), s()      # headers
        out.append((code, s()))
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("store"))
    work = str(tmp_path_factory.mktemp("src"))
    text, image = mar.text_archive(store), mar.image_archive(store)
    v2 = archive_v2(store, work)
    token = os.path.join(work, "token")
    with open(token, "w") as f:
        f.write(TOKEN)
    os.chmod(token, 0o600)
    d = str(tmp_path_factory.mktemp("b"))
    cfg = {"model_store": store, "server": {"auth_token_file": token},
           "torchserve": {"inference_port": 0, "management_port": 0, "models": ["textclf.mar"]},
           "workers": {"devices": ["cpu"], "threads_per_worker": 1}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TGW_TOKEN", TOKEN)   # the native client's, to see it ready
        broker = BrokerProc(cfg, d).start(timeout=120)
    with Client(broker.address, token=TOKEN) as c:
        broker.inference, broker.management = c.status()["torchserve"].split()
    yield broker, {"text": text, "image": image, "v2": v2}
    assert broker.stop() == 0


def ts_error(resp, code: int, kind: str, message: str) -> None:
    assert (resp.status_code, resp.json()) == (code, {"code": code, "type": kind, "message": message})


@pytest.mark.process
def test_predictions_answer_as_torchservers_worker(served):
    broker, files = served
    inf = broker.inference
    assert requests.get(f"{inf}/ping").json() == {"status": "Healthy"}   # open, as for load balancers
    sentence = mar.SENTENCES[1]
    resp = requests.post(f"{inf}/predictions/textclf", data=sentence, headers={**AUTH, "Content-Type": "text/plain"})
    want = torchserve_answer(files["text"], [{"params": [("body", "text/plain", sentence.encode())]}])
    assert (resp.status_code, resp.content) == want[0]
    assert resp.json() == pytest.approx(mar.reference_text(os.path.join(os.path.dirname(files["text"]),
                                                                        ".textclf-src"), sentence))
    # the token, as TorchServe's token authorization words it
    ts_error(requests.post(f"{inf}/predictions/textclf", data=sentence), 400, "InvalidKeyException",
             "Token Authorization failed. Token either incorrect, expired, or not provided correctly")
    ts_error(requests.post(f"{inf}/predictions/nope", data=b"x", headers=AUTH), 404, "ModelNotFoundException",
             "Model not found: nope")
    ts_error(requests.post(f"{inf}/predictions/textclf/9.9", data=b"x", headers=AUTH), 404,
             "ModelVersionNotFoundException", "Model version: 9.9 does not exist for model: textclf")
    # a handler that raises: TorchServe's 503 text, and the model serves on
    ts_error(requests.post(f"{inf}/predictions/textclf", data=b"\xff\xfe", headers={**AUTH, "Content-Type":
                                                                                      "application/octet-stream"}),
             503, "InternalServerException", "Prediction failed")
    assert requests.post(f"{inf}/predictions/textclf", data=sentence, headers=AUTH).status_code == 200


@pytest.mark.process
def test_management_registers_a_custom_handler_batched_with_versions(served):
    broker, files = served
    inf, man = broker.inference, broker.management
    ts_error(requests.post(f"{man}/models?url=imgclf.mar"), 400, "InvalidKeyException",
             "Token Authorization failed. Token either incorrect, expired, or not provided correctly")
    ts_error(requests.post(f"{man}/models", headers=AUTH), 400, "BadRequestException", "Parameter url is required.")
    resp = requests.post(f"{man}/models?url=imgclf.mar&batch_size=4&max_batch_delay=5000&initial_workers=1",
                         headers=AUTH)
    assert resp.json() == {"status": 'Model "imgclf" Version: 1.0 registered with 1 initial workers'}
    ts_error(requests.post(f"{man}/models?url=imgclf.mar", headers=AUTH), 409, "ConflictStatusException",
             "Model version 1.0 is already registered for model imgclf")
    assert requests.get(f"{man}/models", headers=AUTH).json() == {"models": [
        {"modelName": "imgclf", "modelUrl": "imgclf.mar"}, {"modelName": "textclf", "modelUrl": "textclf.mar"}]}
    assert requests.get(f"{man}/models?limit=1", headers=AUTH).json() == {
        "nextPageToken": "1", "models": [{"modelName": "imgclf", "modelUrl": "imgclf.mar"}]}
    (desc,) = requests.get(f"{man}/models/imgclf", headers=AUTH).json()
    assert (desc["modelVersion"], desc["batchSize"], desc["maxBatchDelay"], desc["loadedAtStartup"]) == \
        ("1.0", 4, 5000, False) and desc["workers"][0]["status"] == "READY"

    # four requests, multipart and raw, held into one batch of 4 (max_batch_delay 5 s, batch_size 4)
    images = [mar.sample_image(fmt, seed=k) for k, fmt in enumerate(("JPEG", "PNG", "JPEG", "PNG"))]

    def post(k: int):
        if k % 2:
            return requests.post(f"{inf}/predictions/imgclf", files={"data": ("x.png", images[k], "image/png")},
                                 headers=AUTH)
        return requests.post(f"{inf}/predictions/imgclf", data=images[k], headers={**AUTH, "Content-Type": "image/jpeg"})
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(post, range(4)))
    want = torchserve_answer(files["image"], [{"params": [("data", "image/png", im)] if k % 2 else
                                               [("body", "image/jpeg", im)]} for k, im in enumerate(images)], 4)
    assert [(r.status_code, r.content) for r in got] == want
    with Client(broker.address, token=TOKEN) as c:
        assert c.stats()["models"]["imgclf"]["batch_sizes"] == {"4": 1}

    # a second version, by `tgw-broker models load FILE.mar`: named by path; the default moves only by set-default
    token_file = os.path.join(broker.dir, "token")
    with open(token_file, "w") as f:
        f.write(TOKEN)
    os.chmod(token_file, 0o600)
    out = subprocess.run([sys.executable, "-m", "tgw.broker", "models", "load", "imgclf-v2.mar", "--address",
                          broker.address, "--token-file", token_file], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (0, 'Model "imgclf" Version: 2.0 registered with 1 initial workers\n'), \
        out.stderr
    assert [d["modelVersion"] for d in requests.get(f"{man}/models/imgclf/all", headers=AUTH).json()] == ["1.0", "2.0"]
    one = {"params": [("body", "image/jpeg", images[0])]}
    v1, v2 = torchserve_answer(files["image"], [one])[0][1], torchserve_answer(files["v2"], [one])[0][1]
    assert len(json.loads(v1)) == 3 and len(json.loads(v2)) == 2
    ask = lambda path: requests.post(f"{inf}/predictions/{path}", data=images[0],  # noqa: E731
                                     headers={**AUTH, "Content-Type": "image/jpeg"}).content
    assert (ask("imgclf"), ask("imgclf/2.0"), ask("imgclf/1.0")) == (v1, v2, v1)
    # a reload of the config file keeps what the store serves (the archives are no entries of the file)
    out = subprocess.run([sys.executable, "-m", "tgw.broker", "reload", "--address", broker.address, "--token-file",
                          token_file], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "no changes" in out.stdout, out.stdout + out.stderr
    assert (ask("imgclf"), ask("imgclf/2.0")) == (v1, v2)
    assert requests.put(f"{man}/models/imgclf/2.0/set-default", headers=AUTH).json() == {
        "status": 'Default version successfully updated for model "imgclf" to "2.0"'}
    assert ask("imgclf") == v2
    ts_error(requests.delete(f"{man}/models/imgclf/2.0", headers=AUTH), 403, "InvalidModelVersionException",
             "Cannot remove default version for model imgclf")
    assert requests.delete(f"{man}/models/imgclf/1.0", headers=AUTH).json() == {"status": 'Model "imgclf" unregistered'}
    ts_error(requests.post(f"{inf}/predictions/imgclf/1.0", data=images[0], headers=AUTH), 404,
             "ModelVersionNotFoundException", "Model version: 1.0 does not exist for model: imgclf")
    assert requests.delete(f"{man}/models/imgclf", headers=AUTH).status_code == 200
    ts_error(requests.post(f"{inf}/predictions/imgclf", data=images[0], headers=AUTH), 404, "ModelNotFoundException",
             "Model not found: imgclf")
    ts_error(requests.get(f"{man}/models/imgclf", headers=AUTH), 404, "ModelNotFoundException", "Model not found: imgclf")
    ts_error(requests.post(f"{man}/models?url=http://example.com/x.mar", headers=AUTH), 400, "BadRequestException",
             f"url 'http://example.com/x.mar': tgw downloads no archive; put the file in the model store "
             f"({os.path.realpath(os.path.dirname(files['image']))}) and register it by its name")
    assert requests.get(f"{man}/models", headers=AUTH).json() == {"models": [
        {"modelName": "textclf", "modelUrl": "textclf.mar"}]}
