"""The embedded demo's config with its stages and pipelines (broker/demo.py): it loads, `tgw-broker
check-config` accepts it as a file, and a broker serving its two pipelines answers as the same
steps run in-process (tgw.workers.demo_reference), a corrupt image failing only its own request,
and its generator tiny-gpt streams (Client and AsyncClient) what the model generates in-process.

The demo files are built once per module in a temporary folder, without the AOTInductor model
($CXX points nowhere: its ~30 s compile is tests/process/test_formats.py's) and with tiny-gpt's
weights trained for 150 steps, not the demo's 1,200 (its training is test_demo_generator.py's)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import readme_block
from tgw.testing.child import BrokerProc
from tgw.broker.cli.demo import DEMO_PIPELINES, demo_config, demo_config_data
from tgw.client import AsyncClient, Client, InvalidArgumentError

TGW_BROKER = str(Path(sys.executable).parent / "tgw-broker")
STAGES = {"decode-image", "top5", "tokenize", "l2-normalize"}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from tgw.workers.demo_generator import GPTConfig, build_gpt, save_gpt
    from tgw.workers.demo_models import GPT_CONFIG, GPT_FILE
    folder = str(tmp_path_factory.mktemp("demo"))
    save_gpt(build_gpt(GPTConfig(**GPT_CONFIG), seed=1, train_steps=150), os.path.join(folder, GPT_FILE))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CXX", "/nonexistent/c++")
        yield folder, demo_config_data(out_dir=folder)


def test_the_demo_config_serves_the_stages_on_a_stage_worker_both_pipelines_and_the_generator(demo_dir):
    folder, _ = demo_dir
    cfg = demo_config(out_dir=folder)
    plain = [m for m in cfg.models if m.is_stage and m.generator is None and m.sequence_batching is None]
    assert {m.name for m in plain} == STAGES
    gpt = next(m for m in cfg.models if m.generator is not None)
    assert gpt.name == "tiny-gpt" and gpt.versions[0].handler == "tgw.workers.demo_generator:TinyGPT"
    assert gpt.generator.state[0].shape == [2, 2, 4, 256, 16] and gpt.generator.end_tokens == [0]
    assert {"mlp", "resnet", "embed", "mlp-export"} <= {m.name for m in cfg.models if not m.is_stage}
    assert all(m.device in (None, "cpu") and m.versions[0].handler.startswith("tgw.workers.demo_stages:")
               for m in plain)
    seq = {m.name: m for m in cfg.models if m.sequence_batching is not None}   # workers/demo_sequence.py
    assert sorted(seq) == ["accumulator", "tiny-rnn"] and not seq["accumulator"].is_stage and seq["tiny-rnn"].is_stage
    assert [c.name for c in seq["accumulator"].sequence_batching.control_inputs] == ["START", "END", "READY"]
    assert cfg.workers.stage_workers == 1
    assert [p.name for p in cfg.pipelines] == ["classify", "embed-text"]
    for name in ("labels.txt", "tokenizer.json"):
        assert os.path.exists(os.path.join(folder, name))
    assert len(os.listdir(os.path.join(folder, "images"))) >= 5


def test_check_config_accepts_the_demo_config_as_a_file(demo_dir, tmp_path):
    _, data = demo_dir
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(data))
    r = subprocess.run([TGW_BROKER, "check-config", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 pipeline(s)" in r.stdout and "classify" in r.stdout and "embed-text" in r.stdout, r.stdout


@pytest.fixture(scope="module")
def pipelines_broker(demo_dir, tmp_path_factory):
    """A broker serving only the demo's pipelines: their stages, resnet and embed."""
    folder, data = demo_dir
    wanted = {s["model"] for p in DEMO_PIPELINES for s in p["steps"]}
    config = {**data, "workers": {"devices": ["cpu"], "threads_per_worker": 1, "stage_workers": 1},
              "models": [m for m in data["models"] if m["name"] in wanted]}
    broker = BrokerProc(config, str(tmp_path_factory.mktemp("b"))).start(timeout=120)
    yield broker
    broker.stop()


def images(folder: str) -> list[bytes]:
    return [open(os.path.join(folder, "images", n), "rb").read() for n in sorted(os.listdir(os.path.join(folder, "images")))]


def test_the_pipelines_answer_as_the_same_steps_in_process(demo_dir, pipelines_broker):
    from tgw.workers.demo_reference import DemoPipelines
    folder, _ = demo_dir
    reference = DemoPipelines(folder)
    sent = images(folder)[:4]
    texts = [b"a pipeline decodes the picture", "Zebras and pelicans: ünïcode".encode()]
    with Client(pipelines_broker.address) as c:
        got = c.infer("classify", {"image": sent}, timeout=60)
        embedded = c.infer("embed-text", {"text": texts}, timeout=60)
    for row, ref in enumerate(reference.run("classify", sent)):
        assert [bytes(x) for x in got["labels"][row]] == ref["labels"]
        np.testing.assert_allclose(got["scores"][row], ref["scores"], rtol=0, atol=1e-5)
    for row, ref in enumerate(reference.run("embed-text", texts)):
        np.testing.assert_allclose(embedded["embedding"][row], ref["embedding"], rtol=0, atol=1e-5)
        assert abs(float(np.linalg.norm(embedded["embedding"][row])) - 1.0) < 1e-5


def test_a_corrupt_image_fails_alone(demo_dir, pipelines_broker):
    folder, _ = demo_dir
    with Client(pipelines_broker.address) as c:
        with pytest.raises(InvalidArgumentError, match="not a decodable JPEG"):
            c.infer("classify", {"image": [b"\xff\xd8\xff not a JPEG"]}, timeout=60)
        assert len(c.infer("classify", {"image": images(folder)[:1]}, timeout=60)["labels"][0]) == 5


def test_the_generator_streams_what_the_model_generates_in_process(demo_dir, tmp_path, monkeypatch, capsys):
    """tiny-gpt alone: three prompts from threads of one Client and three from one AsyncClient at
    once, each sequence checked against the float64 reference (check_against_reference); and
    docs/GENERATION.md's client example, run as printed."""
    import threading

    from tgw.workers.demo_generator import END, check_against_reference, float64_reference, load_gpt
    from tgw.workers.demo_models import GPT_FILE
    from tgw.workers.demo_tokenizer import Tokenizer
    folder, data = demo_dir
    config = {**data, "workers": {"devices": ["cpu"], "threads_per_worker": 1, "stage_workers": 1},
              "models": [m for m in data["models"] if m["name"] == "tiny-gpt"], "pipelines": []}
    tok = Tokenizer()
    prompts = ["The server ", "A model decodes ", "Batching", "When a picture ", "Good software ", "x"]
    got: dict[int, tuple] = {}

    def sync(c: Client, i: int) -> None:
        stream = c.generate("tiny-gpt", {"prompt": np.array(tok.encode(prompts[i]))}, max_outputs=40, timeout=60)
        got[i] = (list(stream), stream.final)

    async def streams(address: str) -> None:
        async with AsyncClient(address) as ac:
            async def one(i: int) -> None:
                stream = ac.generate("tiny-gpt", {"prompt": np.array(tok.encode(prompts[i]))}, max_outputs=40,
                                     timeout=60)
                got[i] = ([t async for t in stream], stream.final)
            await asyncio.gather(*(one(i) for i in range(3, 6)))

    broker = BrokerProc(config, str(tmp_path)).start(timeout=120)
    try:
        with Client(broker.address) as c:
            threads = [threading.Thread(target=sync, args=(c, i)) for i in range(3)]
            for t in threads:
                t.start()
            asyncio.run(streams(broker.address))
            for t in threads:
                t.join()
        monkeypatch.setenv("TGW_ADDRESS", broker.address)
        exec(readme_block("generator-example:stream"), {})
    finally:
        broker.stop()
    printed = capsys.readouterr().out   # the decoded text (here maybe blanks: 150 steps of training), the reason
    assert printed.rstrip().endswith(("max_outputs", "stop_token")), printed
    reference = float64_reference(load_gpt(os.path.join(folder, GPT_FILE)))
    compared = 0
    for i, prompt in enumerate(prompts):
        tokens, final = got[i]
        assert final.reason in ("max_outputs", "stop_token") and final.outputs == len(tokens) > 0
        verdict = check_against_reference(reference, tok.encode(prompt), tokens, end_tokens=(END,),
                                          reason=final.reason, max_outputs=40)
        assert verdict.ok, f"{prompt!r}: {verdict.message}"
        compared += verdict.compared
    assert compared >= 0.8 * sum(len(got[i][0]) for i in got)   # near ties are rare: nearly all compared
