"""The OpenAI-compatible face end to end: a real broker serving the demo's tiny-gpt with its
token on, driven by the real `openai` client (sync and async, streamed and not, completions and
chat). Every text is the native Client.generate of the same prompt, decoded with the byte
tokenizer (the same worker computes both)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest

from conftest import in_flight, readme_block, served, wait_until
from tgw.broker.cli.demo import model_entry
from tgw.client import Client
from tgw.shm.byte_tokenizer import Tokenizer

TOKEN = "0penai-face-t0ken"
MODEL = "tiny-gpt"
TOK = Tokenizer()


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    from tgw.workers.demo_generator import GPTConfig, build_gpt, save_gpt
    from tgw.workers.demo_models import GPT_CONFIG, GPT_FILE, build_generator_decls
    folder = str(tmp_path_factory.mktemp("gpt"))
    save_gpt(build_gpt(GPTConfig(**GPT_CONFIG), seed=1, train_steps=150), os.path.join(folder, GPT_FILE))
    d = tempfile.mkdtemp(prefix="tgwo-", dir="/tmp")
    token_file = os.path.join(d, "token")
    with open(token_file, "w") as f:
        f.write(TOKEN)
    os.chmod(token_file, 0o600)
    cfg = {"server": {"auth_token_file": token_file}, "supervisor": {"hang_timeout_s": 120},   # a paused worker
           "workers": {"devices": ["cpu"], "threads_per_worker": 1},
           "http": {"port": 0}, "tenants": {"tiny": {"rate": 0.001, "burst": 1}},
           "models": [model_entry(n, m) for n, m in build_generator_decls(folder).items()]}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TGW_TOKEN", TOKEN)   # the native client's
        yield from served(cfg, d, http=True)


@pytest.fixture(scope="module")
def native(broker):
    with Client(broker.address) as c:
        yield c


def generated(native: Client, prompt: str, n: int, **sampling) -> tuple[str, str, int]:
    """The native stream's text, end reason and token count for `prompt`."""
    stream = native.generate(MODEL, {"prompt": np.array(TOK.encode(prompt))}, max_outputs=n,
                             sampling=sampling or None, timeout=60)
    tokens = list(stream)
    return TOK.decode(tokens), stream.final.reason, len(tokens)


FINISH = {"max_outputs": "length", "max_length": "length", "stop_token": "stop"}
PROMPT = "The server "


def test_four_modes_answer_the_native_text(broker, native):
    """Completions and chat, sync and async, streamed and not: each text, finish_reason and usage
    as the native stream's; the chat prompt is the model's template of the messages."""
    want, reason, count = generated(native, PROMPT, 40)
    messages = [{"role": "system", "content": "Batching"}, {"role": "user", "content": "A model decodes"}]
    chat_want, chat_reason, chat_count = generated(native, "Batching\nA model decodes", 30)
    requests = native.stats()["models"][MODEL]["requests"]
    sync = openai.OpenAI(base_url=f"{broker.http}/v1", api_key=TOKEN)
    assert [m.id for m in sync.models.list().data] == [MODEL]
    assert sync.models.retrieve(MODEL).id == MODEL

    c = sync.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    assert (c.object, c.choices[0].text, c.choices[0].finish_reason) == ("text_completion", want, FINISH[reason])
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == \
        (len(PROMPT), count, len(PROMPT) + count)

    chunks = list(sync.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                          stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == FINISH[reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == count


    async def chat_modes():
        client = openai.AsyncOpenAI(base_url=f"{broker.http}/v1", api_key=TOKEN)
        whole = await client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=30,
                                                     temperature=0)
        pieces, finish, roles = [], None, []
        async for ch in await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30,
                                                              temperature=0, stream=True):
            delta = ch.choices[0].delta
            roles.append(delta.role)
            pieces.append(delta.content or "")
            finish = ch.choices[0].finish_reason or finish
        await client.close()
        return whole, "".join(pieces), finish, roles
    whole, streamed, finish, roles = asyncio.run(chat_modes())
    assert (whole.object, whole.choices[0].message.role, whole.choices[0].message.content) == \
        ("chat.completion", "assistant", chat_want)
    assert whole.choices[0].finish_reason == FINISH[chat_reason] == finish
    assert whole.usage.completion_tokens == chat_count and whole.usage.prompt_tokens == len("Batching\nA model decodes")
    assert streamed == chat_want and roles[0] == "assistant"
    assert native.stats()["models"][MODEL]["requests"] == requests + 4   # counted as every face's


def test_stop_n_and_seeds(broker, native):
    """`stop` ends the text before the stop string (finish_reason stop); n=2 with a seed gives the
    native streams of seeds seed and seed+1."""
    want, _, _ = generated(native, PROMPT, 60)
    assert len(want) > 20
    stop = want[12:15]   # its first occurrence may come earlier: the text ends there
    client = openai.OpenAI(base_url=f"{broker.http}/v1", api_key=TOKEN)
    for stream in (False, True):
        got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0, stop=[stop, "@@never@@"],
                                        stream=stream)
        if stream:
            chunks = list(got)
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = got.choices[0].text, got.choices[0].finish_reason
        assert (text, finish) == (want[:want.find(stop)], "stop"), stream

    sampled = [generated(native, PROMPT, 20, temperature=1.0, seed=s)[0] for s in (7, 8)]
    assert sampled[0] != sampled[1]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=7, n=2)
    assert [c.index for c in got.choices] == [0, 1] and [c.text for c in got.choices] == sampled
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], n=2, seed=7,
                                          temperature=1.0, max_tokens=20, stream=True)
    texts = ["", ""]
    for ch in chat:
        texts[ch.choices[0].index] += ch.choices[0].delta.content or ""
    assert texts == sampled


def test_errors_in_openai_shape(broker):
    """An unknown model or path is 404, an unsupported or bad parameter 400 naming it, a tenant
    over its rate 429, a wrong key 401; each in OpenAI's error shape."""
    client = openai.OpenAI(base_url=f"{broker.http}/v1", api_key=TOKEN, max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="mlp", prompt="x")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    for kwargs, param in (({"logprobs": 2}, "logprobs"), ({"top_p": 5}, "top_p"), ({"n": 99}, "n"),
                          ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"echo": True}, "echo"),
                          ({"extra_body": {"bogus": 1}}, "bogus"), ({"max_tokens": 10_000}, "max_tokens")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", **kwargs)
        assert set(e.value.body) == {"message", "type", "param", "code"} and e.value.body["param"] == param, kwargs
        assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.NotFoundError) as e:
        client.get("/nothing-here", cast_to=object)
    assert e.value.body["code"] == "unknown_url"
    tiny = {"tgw-tenant": "tiny"}   # a tenant's quota, as every face's: one request, then 429
    client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_headers=tiny)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_headers=tiny)
    assert e.value.body["type"] == "rate_limit_error" and "RATE_LIMITED" in e.value.body["message"]
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{broker.http}/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(urllib.error.HTTPError) as e:   # no token at all
        urllib.request.urlopen(f"{broker.http}/v1/models", timeout=30)
    assert e.value.code == 401 and json.loads(e.value.read())["error"]["type"] == "authentication_error"
    assert e.value.headers["endpoint-load-metrics"]   # the load report, as on every HTTP answer


def test_a_client_that_disconnects_frees_its_slot(broker, native):
    """The worker is paused once a streamed completion reached it; the client hangs up; the broker
    withdraws the stream, and once the worker runs again the sequence is cancelled at its next
    step and its slot freed."""
    gen = lambda: native.status()["models"][MODEL]["generation"]   # noqa: E731
    freed = gen()["freed_by_cancel"]
    host, port = broker.http.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True}).encode()
    workers = [p["pid"] for p in native.stats()["processes"] if p["role"] == "worker"]
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        wait_until(lambda: in_flight(native) == 1, what="the generation handed to the worker")
        s.close()
        native.status()   # a round trip on the broker's loop, which saw the hang-up first
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
    # had it not been withdrawn, the sequence would run its 200 steps and end max_outputs
    wait_until(lambda: gen()["active"] == 0 and gen()["freed_by_cancel"] == freed + 1, what="the slot freed")
    assert sum(native.stats()["cancelled"][MODEL].values()) >= 1


def test_a_client_that_hangs_up_mid_stream_frees_its_slot(broker, native):
    """The openai client reads a stream's first chunk; the worker is paused with the sequence
    still running (tried again if it had already ended); the client closes the stream; once the
    worker runs again, the sequence is cancelled at its next step and its slot freed."""
    gen = lambda: native.status()["models"][MODEL]["generation"]   # noqa: E731
    workers = [p["pid"] for p in native.stats()["processes"] if p["role"] == "worker"]
    client = openai.OpenAI(base_url=f"{broker.http}/v1", api_key=TOKEN, max_retries=0)
    for _ in range(5):
        wait_until(lambda: gen()["active"] == 0, what="no sequence running")
        freed = gen()["freed_by_cancel"]
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, stream=True,
                                           extra_body={"top_k": 1})
        assert next(iter(stream)).choices[0].text is not None
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        try:
            running = gen()["active"] == 1
            stream.close()
            native.status()   # a round trip on the broker's loop, which saw the hang-up first
        finally:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        if running:
            wait_until(lambda: gen()["active"] == 0 and gen()["freed_by_cancel"] == freed + 1, what="the slot freed")
            return
    pytest.fail("each of 5 streams had ended before the worker could be paused")


def test_docs_example_runs_as_printed(broker):
    code = readme_block("openai-example:python").replace("http://127.0.0.1:8000", broker.http).replace("TOKEN", TOKEN)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), "the example prints the completions"
