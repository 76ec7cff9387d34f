"""Decoupled gRPC streams (broker/faces/grpc/decoupled.py) read by the real tritonclient.grpc: one
broker for the module with the demo's generator tiny-gpt (weights trained for 150 steps, here),
the test generator `count` (output n of a prompt is (sum(prompt) + n) % 1000) and `slowcount`
(the same at 100 outputs/s, a million of them: it runs until cancelled), and the demo's sequence
model `accumulator` (a Triton-PyTorch-backend model file: OUTPUT is its sequence's running sum).

tiny-gpt's greedy stream equals the native Client.generate of the same prompt; each output is
one response with the request's id; `triton_final_response` and the empty final as Triton's;
requests on one stream answered each in order, errors as `error_message` while the stream goes
on; unary ModelInfer refused with Triton's words; the config says decoupled; a cancelled stream
(sync client's stop_stream(cancel_requests=True), the aio client's cancel) frees its slots;
Triton's sequence examples' pattern, unary and stream."""
from __future__ import annotations

import asyncio
import os
import queue
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from conftest import readme_block, wait_until
from tgw.client import Client
from tgw.testing.generators import counter_outputs, entry

FINAL = "triton_final_response"


@pytest.fixture(scope="module")
def broker():
    from tgw.broker.cli.demo import model_entry
    from tgw.testing.child import BrokerProc
    from tgw.workers.demo_generator import GPTConfig, build_gpt, save_gpt
    from tgw.workers.demo_models import GPT_CONFIG, GPT_FILE, build_generator_decls
    from tgw.workers.demo_sequence import build_sequence_decls
    d = tempfile.mkdtemp(prefix="tgwgs-", dir="/tmp")
    save_gpt(build_gpt(GPTConfig(**GPT_CONFIG), seed=1, train_steps=150), os.path.join(d, GPT_FILE))
    gpt = model_entry("tiny-gpt", build_generator_decls(d)["tiny-gpt"])
    cfg = {"workers": {"devices": ["cpu"], "threads_per_worker": 1, "stage_workers": 1},
           "models": [gpt, entry("count", "Counter", max_sequences=4, max_outputs=1000),
                      entry("slowcount", "Counter", {"step_ms": 10}, max_sequences=4, max_outputs=1_000_000),
                      model_entry("accumulator", build_sequence_decls(d)["accumulator"])],
           "grpc": {"port": 0}}
    b = BrokerProc(cfg, d).start(timeout=120)
    try:
        with Client(b.address) as c:
            b.grpc = c.status()["grpc"]
        yield b
    finally:
        code = b.stop()
        shutil.rmtree(d, ignore_errors=True)
        assert code == 0, b.output()


def prompt(tokens) -> grpcclient.InferInput:
    x = np.array([tokens], dtype=np.int64)
    inp = grpcclient.InferInput("prompt", list(x.shape), "INT64")
    inp.set_data_from_numpy(x)
    return inp


def final_flag(result) -> bool | None:
    p = result.get_response().parameters.get(FINAL)
    return None if p is None else p.bool_param


class Collector:
    """A sync stream's callback: every (result, error) in arrival order."""

    def __init__(self):
        self.got: queue.Queue = queue.Queue()

    def __call__(self, result, error):
        self.got.put((result, error))

    def take(self, n: int) -> list:
        return [self.got.get(timeout=60) for _ in range(n)]


def test_a_generator_streams_as_a_decoupled_triton_model(broker):
    text = b"The server "
    with Client(broker.address) as c:
        want = list(c.generate("tiny-gpt", {"prompt": np.array(list(text))}, max_outputs=30, timeout=60))
    client = grpcclient.InferenceServerClient(broker.grpc)
    try:
        assert client.get_model_config("tiny-gpt").config.model_transaction_policy.decoupled
        with pytest.raises(InferenceServerException) as refused:
            client.infer("tiny-gpt", [prompt(list(text))])
        assert refused.value.status() == "StatusCode.UNIMPLEMENTED"
        assert refused.value.message() == "ModelInfer RPC doesn't support models with decoupled transaction policy"

        got = Collector()
        client.start_stream(got)
        # alone on the stream (so batched alone, as the native one was): greedy, the same tokens
        client.async_stream_infer("tiny-gpt", [prompt(list(text))], request_id="gpt",
                                  parameters={"max_tokens": 30}, enable_empty_final_response=True)
        answers = []
        while not answers or final_flag(answers[-1][0]) is not True:
            answers += got.take(1)
        assert all(err is None for _, err in answers)
        data, last = [r for r, _ in answers[:-1]], answers[-1][0]
        assert [int(r.as_numpy("token")[0]) for r in data] == want and len(want) > 0
        assert all(r.as_numpy("token").shape == (1,) and final_flag(r) is False for r in data)
        for r in (*data, last):
            resp = r.get_response()
            assert (resp.id, resp.model_name, resp.model_version) == ("gpt", "tiny-gpt", "1")
        assert not last.get_response().outputs

        # two generations and four refusals on one stream: each answered in order, the stream goes on
        client.async_stream_infer("count", [prompt([1])], request_id="a", parameters={"max_tokens": 20},
                                  enable_empty_final_response=True)
        client.async_stream_infer("count", [prompt([2, 3])], request_id="b", parameters={"max_outputs": 15})
        client.async_stream_infer("count", [prompt([1])], request_id="big", parameters={"max_tokens": 5000})
        client.async_stream_infer("count", [prompt([1])], request_id="hot", parameters={"temperature": "hot"})
        client.async_stream_infer("count", [prompt([1])], request_id="out",
                                  outputs=[grpcclient.InferRequestedOutput("nope")])
        client.async_stream_infer("nope", [prompt([1])], request_id="gone")
        client.stop_stream()   # closes the sending side: every answer comes first
        rest = []
        while not got.got.empty():
            rest.append(got.got.get())
    finally:
        client.close()
    by_id: dict[str, list] = {}
    errors = {}
    for result, err in rest:
        if err is not None:
            errors[len(errors)] = err.message()
        else:
            by_id.setdefault(result.get_response().id, []).append(result)
    a, b = by_id.pop("a"), by_id.pop("b")
    assert not by_id
    assert [int(r.as_numpy("value")[0]) for r in a[:-1]] == counter_outputs([1], 20)
    assert [final_flag(r) for r in a] == [False] * 20 + [True] and not a[-1].get_response().outputs
    assert [int(r.as_numpy("value")[0]) for r in b] == counter_outputs([2, 3], 15)
    assert [final_flag(r) for r in b] == [False] * 15   # no empty final unless asked for
    text = sorted(errors.values())
    assert len(text) == 4, text
    assert any("1..1000" in t for t in text) and any("temperature must be a number" in t for t in text)
    # the message alone, as Triton's (tgw's code: the response's tgw_code parameter)
    assert any("'nope'" in t and "no output" in t for t in text) and any("Request for unknown model" in t for t in text)


def test_a_cancelled_stream_frees_its_slots(broker):
    client = grpcclient.InferenceServerClient(broker.grpc)
    got = Collector()
    client.start_stream(got)
    client.async_stream_infer("slowcount", [prompt([10])], request_id="s")
    first, err = got.take(1)[0]
    assert err is None and int(first.as_numpy("value")[0]) == 10
    # another request on the same stream runs beside it: their responses interleave
    client.async_stream_infer("count", [prompt([5])], request_id="i", parameters={"max_tokens": 3},
                              enable_empty_final_response=True)
    seen, last = {"s": [10], "i": []}, ""
    while len(seen["i"]) < 4 or len(seen["s"]) < 2 or last != "s":   # i's three and its final, then s again
        result, err = got.take(1)[0]
        assert err is None
        last = result.get_response().id
        seen[last].append(int(result.as_numpy("value")[0]) if result.get_response().outputs else None)
    assert seen["i"] == [5, 6, 7, None] and seen["s"] == list(range(10, 10 + len(seen["s"])))
    client.stop_stream(cancel_requests=True)
    client.close()

    async def aio_cancel():
        async with aioclient.InferenceServerClient(broker.grpc) as ac:
            async def requests():
                yield {"model_name": "slowcount", "inputs": [prompt([20])], "request_id": "t"}
                await asyncio.Event().wait()   # the sending side stays open
            stream = ac.stream_infer(requests())
            async for result, error in stream:
                assert error is None and int(result.as_numpy("value")[0]) == 20
                break
            stream.cancel()
    asyncio.run(aio_cancel())
    with Client(broker.address) as c:
        g = wait_until(lambda: (lambda g: g if g["freed_by_cancel"] >= 2 and g["active"] == 0 else None)(
            c.status()["models"]["slowcount"]["generation"]), what="both cancelled sequences' slots freed")
    assert g["freed_by_cancel"] == 2 and g["ended"] == {"cancelled": 2}


def test_doc_example_runs_as_printed(broker):
    port = broker.grpc.rsplit(":", 1)[1]
    code = readme_block("grpc-example:decoupled").replace(":8001", f":{port}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "final" and len(lines) == 2, out.stdout


def test_triton_sequence_pattern_unary_and_stream(broker):
    """Triton's simple_grpc_sequence clients' pattern: two sequences interleaved with start,
    middle and end flags, each answer its sequence's running sum; first one stepped by unary
    infer while the other steps on a stream, then two sent whole on one stream (each sequence's
    steps run in the order sent). A step of an ended or unknown sequence is refused by name."""
    def request(value: int) -> list:
        inp = grpcclient.InferInput("INPUT", [1, 1], "INT32")
        inp.set_data_from_numpy(np.array([[value]], np.int32))
        return [inp]

    def total(result) -> int:
        return int(result.as_numpy("OUTPUT")[0, 0])

    values = [11, 7, 5, 3, 2, 0, 1]
    sums = np.cumsum(values).tolist()
    client = grpcclient.InferenceServerClient(broker.grpc)
    got = Collector()
    try:
        sb = client.get_model_config("accumulator").config.sequence_batching
        assert sb.max_sequence_idle_microseconds == 5_000_000 and sb.WhichOneof("strategy_choice") == "oldest"
        assert [(c.name, c.control[0].int32_false_true) for c in sb.control_input] == [
            ("START", [0, 1]), ("END", [0, 1]), ("READY", [0, 1])]
        assert (sb.state[0].input_name, sb.state[0].output_name, sb.state[0].initial_state[0].zero_data) == \
            ("INPUT_STATE", "OUTPUT_STATE", True)
        client.start_stream(got)
        unary, streamed = [], []
        for i, v in enumerate(values):
            flags = {"sequence_start": i == 0, "sequence_end": i == len(values) - 1}
            client.async_stream_infer("accumulator", request(-v), request_id=f"b{i}", sequence_id=1001, **flags)
            unary.append(total(client.infer("accumulator", request(v), sequence_id=1000, **flags)))
            result, err = got.take(1)[0]
            assert err is None and result.get_response().id == f"b{i}"
            streamed.append(total(result))
        assert unary == sums and streamed == [-s for s in sums]

        for i, v in enumerate(values):   # all at once: no step waits for the one before
            flags = {"sequence_start": i == 0, "sequence_end": i == len(values) - 1}
            client.async_stream_infer("accumulator", request(v), request_id=f"c{i}", sequence_id=2000, **flags)
            client.async_stream_infer("accumulator", request(2 * v), request_id=f"d{i}", sequence_id=2001, **flags)
        answers = got.take(2 * len(values))
        assert all(err is None for _, err in answers)
        by_id = {r.get_response().id: total(r) for r, _ in answers}
        assert [by_id[f"c{i}"] for i in range(len(values))] == sums
        assert [by_id[f"d{i}"] for i in range(len(values))] == [2 * s for s in sums]

        client.async_stream_infer("accumulator", request(1), request_id="late", sequence_id=2000)
        result, err = got.take(1)[0]
        assert result is None and "sequence 2000" in err.message() \
            and "ended" in err.message()
        with pytest.raises(InferenceServerException, match="sequence 4242 .*must specify the START flag") as unknown:
            client.infer("accumulator", request(1), sequence_id=4242)
        assert unknown.value.status() == "StatusCode.INVALID_ARGUMENT"
        with pytest.raises(InferenceServerException, match="takes uint64 correlation IDs"):
            client.infer("accumulator", request(1), sequence_id="abc", sequence_start=True)
        assert total(client.infer("accumulator", request(4), sequence_id=1000, sequence_start=True,
                                  sequence_end=True)) == 4   # started again: a sequence of one
        client.stop_stream()
    finally:
        client.close()
