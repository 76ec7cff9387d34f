"""Triton's generate extension on the HTTP face end to end: a real broker serving the demo's
tiny-gpt (150 training steps), the test model `mixed` and the test generator `slowcount`
(tgw.testing.generators' Counter at 100 outputs/s, a million at most: it runs until closed; its
readers may leave them all unread, so only a withdrawal ends it), `pacedcount` (as
slow, 25 unread at most), `fastcount` (unpaced, 64 unread at most) and `failcount` (a Counter
whose step raises at output 3), driven by aiohttp reading the SSE
stream line by line, and `curl -N`. Greedy tokens over HTTP must equal the native Client.generate's
for the same prompt (the same worker computes both); a client that closes its stream frees its
slot at the next step. The same broker serves the demo's `accumulator` (a Triton-PyTorch-backend
sequence model): Triton's sequence example pattern over tritonclient.http, sync and async."""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import tempfile

import aiohttp
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import model_entry, readme_block, served, wait_until
from tgw.client import Client

CURL = shutil.which("curl")
PROMPT = "The server "


@pytest.fixture(scope="module")
def gen_broker(model_files, tmp_path_factory):
    from tgw.workers.demo_generator import GPTConfig, build_gpt, save_gpt
    from tgw.workers.demo_models import GPT_CONFIG, GPT_FILE, build_generator_decls
    from tgw.testing.generators import entry
    from tgw.broker.cli.demo import model_entry as demo_model_entry
    from tgw.workers.demo_sequence import build_sequence_decls
    folder = str(tmp_path_factory.mktemp("gpt"))
    save_gpt(build_gpt(GPTConfig(**GPT_CONFIG), seed=1, train_steps=150), os.path.join(folder, GPT_FILE))
    gpt = demo_model_entry("tiny-gpt", build_generator_decls(folder)["tiny-gpt"])
    cfg = {"workers": {"devices": ["cpu"], "threads_per_worker": 1, "stage_workers": 1},
           "models": [gpt, model_entry(model_files, "mixed"),
                      entry("slowcount", "Counter", {"step_ms": 10}, max_sequences=2, max_outputs=1_000_000,
                            max_unread_outputs=1_000_000),
                      entry("pacedcount", "Counter", {"step_ms": 10}, max_sequences=2, max_unread_outputs=25),
                      entry("failcount", "Counter", {"raise_at": 3}, max_sequences=2),
                      entry("fastcount", "Counter", max_sequences=2, max_outputs=1_000_000, max_unread_outputs=64),
                      demo_model_entry("accumulator", build_sequence_decls(folder)["accumulator"])],
           "http": {"port": 0}}
    yield from served(cfg, tempfile.mkdtemp(prefix="tgwg-", dir="/tmp"), http=True)


def prompt() -> list[int]:
    from tgw.workers.demo_tokenizer import Tokenizer
    return Tokenizer().encode(PROMPT)


def native_tokens(address: str, n: int) -> list[int]:
    with Client(address) as c:
        return list(c.generate("tiny-gpt", {"prompt": np.array(prompt())}, max_outputs=n, timeout=60))


async def sse(url: str, doc: dict) -> tuple[int, str, list[dict]]:
    """Status, Content-Type and the events of a /generate_stream, read line by line."""
    events = []
    async with aiohttp.ClientSession() as s, s.post(url, json=doc) as r:
        while line := await r.content.readline():
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
        return r.status, r.headers["Content-Type"], events


async def call(url: str, body) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url, data=body if isinstance(body, bytes) else json.dumps(body)) as r:
            return r.status, await r.json(content_type=None)


def test_generate_and_generate_stream_answer_the_native_tokens(gen_broker):
    """/generate, /generate_stream (aiohttp and curl -N), a version in the path; a plain model's
    one-shot answer in the same flat shape; docs/HTTP.md's curl example as printed."""
    base = f"{gen_broker.http}/v2/models/tiny-gpt"
    want = native_tokens(gen_broker.address, 24)
    assert len(want) > 0
    status, doc = asyncio.run(call(f"{base}/generate", {"prompt": prompt(), "max_tokens": 24}))
    assert status == 200 and doc == {"model_name": "tiny-gpt", "model_version": "1", "token": want}
    status, doc = asyncio.run(call(f"{base}/versions/1/generate",
                                   {"prompt": prompt(), "parameters": {"max_tokens": 24, "temperature": 0}}))
    assert status == 200 and doc["token"] == want

    status, ctype, events = asyncio.run(sse(f"{base}/generate_stream", {"prompt": prompt(), "max_tokens": 24}))
    assert status == 200 and ctype == "text/event-stream; charset=utf-8"
    assert [e["token"] for e in events] == want
    assert all(e["model_name"] == "tiny-gpt" and e["model_version"] == "1" for e in events)

    if CURL:
        out = subprocess.run([CURL, "-sN", "-X", "POST", f"{base}/generate_stream", "-d",
                              json.dumps({"prompt": prompt(), "max_tokens": 24})],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        assert [json.loads(line[6:])["token"] for line in out.splitlines() if line.startswith("data: ")] == want

    with Client(gen_broker.address) as c:   # a plain model: its one answer, in the same flat shape
        ref = c.infer("mixed", {"a": np.array([[1, 2, 3, 4]], np.float16), "b": np.array([[1, 0, 1]], bool),
                                "c": np.array([[5, 6, 7]], np.int64)})
    body = {"a": [1, 2, 3, 4], "b": [True, False, True], "c": [5, 6, 7]}
    status, doc = asyncio.run(call(f"{gen_broker.http}/v2/models/mixed/generate", body))
    assert status == 200 and doc["model_name"] == "mixed"
    assert doc["a2"] == ref["a2"][0].tolist() and doc["nb"] == ref["nb"][0].tolist()
    assert doc["csum"] == int(ref["csum"][0])
    status, _, events = asyncio.run(sse(f"{gen_broker.http}/v2/models/mixed/generate_stream", body))
    assert status == 200 and len(events) == 1 and events[0]["csum"] == doc["csum"]

    if CURL:   # the docs' example, with the test's address
        script = readme_block("http-example:generate").replace("localhost:8000",
                                                                          gen_broker.http.removeprefix("http://"))
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, check=True).stdout
        assert out.count("data: ") >= 1 and '"token"' in out, out


def test_every_bad_generate_request_is_a_clear_error(gen_broker):
    http = gen_broker.http
    cases = [  # (path, body, status, code, words in the error)
        ("nope/generate", {"prompt": [1]}, 404, "MODEL_NOT_FOUND", "nope"),
        ("tiny-gpt/versions/9/generate", {"prompt": [1]}, 404, "VERSION_NOT_FOUND", "9"),
        ("tiny-gpt/generate", b"{not json", 400, "INVALID_ARGUMENT", "JSON"),
        ("tiny-gpt/generate", [1, 2], 400, "INVALID_ARGUMENT", "JSON object"),
        ("tiny-gpt/generate", {"max_tokens": 3}, 400, "INVALID_ARGUMENT", "'prompt'"),
        ("tiny-gpt/generate", {"prompt": ["a"]}, 400, "INVALID_INPUT_DTYPE", "prompt"),
        ("tiny-gpt/generate", {"prompt": [[1], [2, 3]]}, 400, "INVALID_INPUT_SHAPE", "prompt"),
        ("tiny-gpt/generate", {"prompt": [1], "max_tokens": "5"}, 400, "INVALID_ARGUMENT", "max_tokens"),
        ("tiny-gpt/generate", {"prompt": [1], "temprature": 0.5}, 400, "INVALID_ARGUMENT", "temprature"),
        ("tiny-gpt/generate_stream", {"prompt": [1], "max_tokens": 100000}, 400, "INVALID_ARGUMENT", "max_outputs"),
        ("mixed/generate", {"a": [1, 2, 3, 4], "b": [True, False, True], "c": [1], "max_tokens": 3}, 400,
         "INVALID_ARGUMENT", "not a generator"),
        ("mixed/generate", {"a": [1, 2, 3], "b": [True, False, True], "c": [1]}, 400, "INVALID_INPUT_SHAPE", "'a'"),
    ]
    for path, body, status, code, words in cases:
        got, doc = asyncio.run(call(f"{http}/v2/models/{path}", body))
        assert (got, doc.get("code")) == (status, code) and words in doc["error"], (path, body, got, doc)


async def read_one_then_close(url: str, doc: dict) -> dict:
    async with aiohttp.ClientSession() as s:
        r = await s.post(url, json=doc)
        line = await r.content.readline()
        r.close()   # the connection goes, mid-stream
        return json.loads(line[6:])


def test_a_client_that_closes_its_stream_frees_its_slot(gen_broker):
    def generation() -> dict:
        with Client(gen_broker.address) as c:
            return c.status()["models"]["slowcount"]["generation"]
    before = generation()
    first = asyncio.run(read_one_then_close(f"{gen_broker.http}/v2/models/slowcount/generate_stream",
                                            {"prompt": [7]}))
    assert first["value"] == 7
    after = wait_until(lambda: (g := generation())["active"] == 0 and g["freed_by_cancel"] > before["freed_by_cancel"]
                       and g, what="the closed stream's slot freed")
    assert after["ended"].get("cancelled", 0) > before["ended"].get("cancelled", 0), after


def test_an_error_after_the_first_output_is_an_error_event(gen_broker):
    """The status went out with the first event: the failure is Triton's error object as the
    last event; /generate answers the same failure as a JSON error with its status."""
    status, ctype, events = asyncio.run(sse(f"{gen_broker.http}/v2/models/failcount/generate_stream",
                                            {"prompt": [10], "max_tokens": 10}))
    assert status == 200 and ctype.startswith("text/event-stream")
    assert [e.get("value") for e in events[:-1]] == [10, 11, 12], events
    assert events[-1]["code"] == "MODEL_EXECUTION_ERROR" and "refuses output 3" in events[-1]["error"], events
    status, doc = asyncio.run(call(f"{gen_broker.http}/v2/models/failcount/generate", {"prompt": [10]}))
    assert status == 500 and doc["code"] == "MODEL_EXECUTION_ERROR" and "refuses output 3" in doc["error"], doc


def test_triton_sequence_pattern_over_http(gen_broker):
    """Triton's simple_http_sequence clients' pattern: two sequences interleaved, start, middle
    and end flags, one stepped with infer and the other with async_infer; each answer is its
    sequence's running sum. A step of an ended or unknown sequence is refused by name."""
    c = httpclient.InferenceServerClient(gen_broker.http.removeprefix("http://"), concurrency=2)

    def request(value: int) -> list:
        inp = httpclient.InferInput("INPUT", [1, 1], "INT32")
        inp.set_data_from_numpy(np.array([[value]], np.int32))
        return [inp]

    def step(cid, value: int, **flags) -> int:
        return int(c.infer("accumulator", request(value), sequence_id=cid, **flags).as_numpy("OUTPUT")[0, 0])

    values = [11, 7, 5, 3, 2, 0, 1]
    got_a, got_b = [], []
    try:
        for i, v in enumerate(values):
            flags = {"sequence_start": i == 0, "sequence_end": i == len(values) - 1}
            pending = c.async_infer("accumulator", request(-v), sequence_id=1001, **flags)   # B, in flight ...
            got_a.append(step(1000, v, **flags))                                             # ... while A steps
            got_b.append(int(pending.get_result().as_numpy("OUTPUT")[0, 0]))
        assert got_a == np.cumsum(values).tolist() and got_b == (-np.cumsum(values)).tolist()
        with pytest.raises(InferenceServerException, match="sequence 1000 .*must specify the START flag.*ended"):
            step(1000, 1)
        with pytest.raises(InferenceServerException, match="sequence 4242 .*must specify the START flag"):
            step(4242, 1)
        with pytest.raises(InferenceServerException, match="takes uint64 correlation IDs"):
            step("abc", 1, sequence_start=True)
        assert step(1000, 4, sequence_start=True, sequence_end=True) == 4   # started again: a sequence of one
    finally:
        c.close()


def test_a_reader_that_falls_behind_is_ended_overloaded(gen_broker):
    """A reader that keeps up reads all of 30 outputs, more than pacedcount's `max_unread_outputs`
    (25: a face's caller takes each output at once, so the door counts none unread); a client
    that stops reading (a small receive buffer, so the face's writes block soon) falls fastcount's
    64 behind: its generation ends and the slot is freed, and what it reads at last ends with the
    OVERLOADED error event."""
    import socket
    from urllib.parse import urlsplit

    def generation() -> dict:
        with Client(gen_broker.address) as c:
            return c.status()["models"]["fastcount"]["generation"]
    # a reader that keeps up (pacedcount: 100 outputs/s; it may lag 250 ms) reads more than 25 ...
    status, _, events = asyncio.run(sse(f"{gen_broker.http}/v2/models/pacedcount/generate_stream",
                                        {"prompt": [1], "max_tokens": 30}))
    assert status == 200 and [e.get("value") for e in events] == list(range(1, 31)), events[-1]
    before = generation()   # ... and one that stops reading
    url = urlsplit(gen_broker.http)
    body = json.dumps({"prompt": [1]}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((url.hostname, url.port))
    s.sendall(b"POST /v2/models/fastcount/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    try:
        wait_until(lambda: (g := generation())["active"] == 0 and g["freed_by_cancel"] > before["freed_by_cancel"],
                   what="the slow reader's slot freed")
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    finally:
        s.close()
    assert data.startswith(b"HTTP/1.1 200 "), data[:300]
    events = [json.loads(m) for m in re.findall(rb"^data: (.*)$", data, re.M)]   # chunked: one event a chunk
    assert [e["value"] for e in events[:3]] == [1, 2, 3]
    assert events[-1]["code"] == "OVERLOADED" and "fell more than 64 outputs behind" in events[-1]["error"], events[-1]

