"""Raw HTTP bodies on a real broker with real curl: the embedded demo's `classify` pipeline (one
BYTES input, JPEG) answers a JPEG sent as the body itself - POST with its Content-Type, or PUT as
`curl -T` - as the native client's infer of the same bytes; docs/HTTP.md's two examples (raw, and
the binary extension built by hand) run as printed; a raw body that cannot feed a model is refused
by name."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from conftest import readme_block
from tgw.broker.cli.demo import DEMO_PIPELINES, demo_config_data
from tgw.client import Client
from tgw.testing.child import BrokerProc

CURL = shutil.which("curl")
pytestmark = pytest.mark.skipif(CURL is None, reason="curl is not installed")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A broker serving the demo's pipelines, with its HTTP face; a demo JPEG as cat.jpg."""
    folder = str(tmp_path_factory.mktemp("demo"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CXX", "/nonexistent/c++")   # no AOTInductor model: its compile is test_formats.py's
        data = demo_config_data(out_dir=folder)
    wanted = {s["model"] for p in DEMO_PIPELINES for s in p["steps"]}
    config = {**data, "http": {"port": 0},
              "workers": {"devices": ["cpu"], "threads_per_worker": 1, "stage_workers": 1},
              "models": [m for m in data["models"] if m["name"] in wanted]}
    broker = BrokerProc(config, str(tmp_path_factory.mktemp("b"))).start(timeout=120)
    with Client(broker.address) as c:
        broker.http = c.status()["http"]
    images = os.path.join(folder, "images")
    work = tmp_path_factory.mktemp("curl")
    shutil.copy(os.path.join(images, sorted(os.listdir(images))[0]), work / "cat.jpg")
    yield broker, work
    assert broker.stop() == 0


def curl(*args: str) -> tuple[int, dict]:
    out = subprocess.run([CURL, "-s", "-w", "\n%{http_code}", *args], capture_output=True, check=True,
                         timeout=60).stdout.decode()
    body, status = out.rsplit("\n", 1)
    return int(status), json.loads(body)


def same_as_native(answer: dict, broker, jpeg: bytes) -> None:
    with Client(broker.address) as c:
        want = c.infer("classify", {"image": [jpeg]}, timeout=60)
    got = {o["name"]: o for o in answer["outputs"]}
    assert got["labels"]["shape"] == [1, 5] and got["labels"]["data"] == [x.decode() for x in want["labels"][0]]
    np.testing.assert_allclose(got["scores"]["data"], want["scores"].reshape(-1), rtol=0, atol=1e-6)


def run_doc_block(marker: str, broker, work) -> list[str]:
    port = broker.http.rsplit(":", 1)[1]
    script = readme_block(marker).replace("localhost:8000", f"127.0.0.1:{port}")
    out = subprocess.run(["bash", "-c", script], cwd=work, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out
    return [line for line in out.stdout.splitlines() if line.strip()]


def test_the_docs_raw_body_and_binary_extension_examples_run_as_printed(demo):
    broker, work = demo
    jpeg = (work / "cat.jpg").read_bytes()
    posted, put = run_doc_block("http-example:raw", broker, work)
    [binary] = run_doc_block("http-example:jpeg", broker, work)
    for line in (posted, put, binary):
        same_as_native(json.loads(line), broker, jpeg)
    assert (work / "body.bin").stat().st_size > len(jpeg) + 4   # the body the doc built: header, length, JPEG


def test_a_raw_body_that_cannot_feed_the_model_is_refused_by_name(demo):
    broker, work = demo
    url = f"{broker.http}/v2/models"
    status, answer = curl("--data-binary", f"@{work / 'cat.jpg'}", "-H", "Content-Type: image/jpeg",
                          f"{url}/resnet/infer")
    assert (status, answer["code"], answer["details"]["reason"]) == (400, "INVALID_ARGUMENT", "raw_body"), answer
    assert "cannot take a raw body" in answer["error"] and "FP32 [-1, 3, 64, 64]" in answer["error"], answer
    status, answer = curl("-F", f"image=@{work / 'cat.jpg'}", f"{url}/classify/infer")
    assert status == 400 and "multipart form body" in answer["error"], answer
    status, answer = curl("-X", "PUT", "--data-binary", "", f"{url}/classify/infer")
    assert status == 400 and "raw body is empty" in answer["error"], answer
    status, answer = curl("--data-binary", f"@{work / 'cat.jpg'}", f"{url}/classify/infer")   # curl -d's form type
    assert status == 400 and "not JSON" in answer["error"] and "Content-Type: image/jpeg" in answer["error"], answer
    status, answer = curl("-T", str(work / "cat.jpg"), f"{url}/nope/infer")
    assert (status, answer["code"]) == (404, "MODEL_NOT_FOUND"), answer
