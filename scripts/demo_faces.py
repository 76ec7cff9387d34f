"""The demo's streams and sequences on every face, with the clients their users already have:

* tiny-gpt's prompts over gRPC (tritonclient's decoupled stream), HTTP `generate_stream`
  (server-sent events) and the `openai` client (completions, streamed), all at once; each
  sequence is checked against the model's greedy run in this process, as demo_generate.py checks
  the native streams;
* the sequence model `accumulator` (a TorchScript file written for Triton's PyTorch backend,
  implicit state) stepped by two interleaved sequences over the native client, HTTP and gRPC
  (tritonclient), each answer checked against the running sum it must be.

Used by demo_traffic.py (scripts/demo.sh); runs on its own too:

    .venv/bin/python scripts/demo_faces.py --address ipc:///tmp/x/tgw.sock --models-dir ~/.cache/tgw/demo
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
import urllib.request

import numpy as np

import demo_generate
from demo_generate import MAX_OUTPUTS, MODEL, PROMPTS

from tgw.client import Client, TgwError
from tgw.workers.demo_tokenizer import Tokenizer

SEQUENCE_MODEL = "accumulator"
SEQUENCE_MODELS = ("accumulator", "tiny-rnn")   # the demo's: plain traffic cannot step them
STEPS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5]]   # two interleaved sequences' inputs


# ---- tiny-gpt over three faces ------------------------------------------------------------------

def grpc_streams(grpc_url: str, prompts: list[str]) -> list[dict]:
    """Every prompt on one tritonclient gRPC stream, interleaved; each request's responses until
    the empty final one (`triton_final_response`)."""
    import tritonclient.grpc as tg
    tok, results, done = Tokenizer(), [{"tokens": []} for _ in prompts], queue.Queue()
    started = [0.0] * len(prompts)

    def callback(result, error):
        if error is not None:
            i = int(error.request_id()) if hasattr(error, "request_id") and error.request_id() else -1
            done.put((i, str(error)))
            return
        response = result.get_response()
        i = int(response.id)
        final = response.parameters.get("triton_final_response")
        token = result.as_numpy("token")
        if token is not None and token.size:
            r = results[i]
            r.setdefault("first_ms", (time.perf_counter() - started[i]) * 1000)
            r["tokens"].extend(int(t) for t in token.reshape(-1))
        if final is not None and final.bool_param:
            done.put((i, None))

    client = tg.InferenceServerClient(grpc_url)
    client.start_stream(callback)
    try:
        for i, prompt in enumerate(prompts):
            ids = np.array([tok.encode(prompt)], dtype=np.int64)
            x = tg.InferInput("prompt", list(ids.shape), "INT64")
            x.set_data_from_numpy(ids)
            started[i] = time.perf_counter()
            client.async_stream_infer(MODEL, [x], request_id=str(i), parameters={"max_tokens": MAX_OUTPUTS},
                                      enable_empty_final_response=True)
        for _ in prompts:
            i, error = done.get(timeout=120)
            if error is not None:
                results[i]["error"] = error
    finally:
        client.stop_stream()
        client.close()
    return results


def sse_stream(http_url: str, prompt: str) -> dict:
    """One prompt over HTTP generate_stream: one `data:` event per token."""
    tok, tokens, t0 = Tokenizer(), [], time.perf_counter()
    body = json.dumps({"prompt": tok.encode(prompt), "max_tokens": MAX_OUTPUTS}).encode()
    req = urllib.request.Request(f"{http_url}/v2/models/{MODEL}/generate_stream", data=body,
                                 headers={"Content-Type": "application/json"})
    out: dict = {"tokens": tokens}
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                out["error"] = event["error"]
                break
            out.setdefault("first_ms", (time.perf_counter() - t0) * 1000)
            tokens.extend(np.asarray(event["token"]).reshape(-1).tolist())
    return out


def openai_stream(http_url: str, prompt: str) -> dict:
    """One prompt through the openai client, streamed; its text back to token ids."""
    import openai
    client = openai.OpenAI(base_url=f"{http_url}/v1", api_key="demo")
    tok, text, t0, out = Tokenizer(), [], time.perf_counter(), {}
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_OUTPUTS, temperature=0,
                                           stream=True):
        if chunk.choices:
            out.setdefault("first_ms", (time.perf_counter() - t0) * 1000)
            text.append(chunk.choices[0].text)
            out["finish_reason"] = chunk.choices[0].finish_reason or out.get("finish_reason")
    out["tokens"] = tok.encode("".join(text))
    return out


def _threads(fn, url: str, prompts: list[str]) -> list[dict]:
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            results[i] = fn(url, prompts[i])
        except Exception as exc:   # a stream's failure is its row's error, never a lost row
            results[i] = {"tokens": [], "error": f"{type(exc).__name__}: {exc}"}
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def generate_on_faces(http_url: str, grpc_url: str, models_dir: str) -> tuple[list[tuple], bool]:
    """Every prompt on each face, the three faces at once; checked against the reference."""
    got: dict[str, list] = {}
    t0 = time.perf_counter()
    jobs = {"grpc": lambda: grpc_streams(grpc_url, PROMPTS),
            "http-sse": lambda: _threads(sse_stream, http_url, PROMPTS),
            "openai": lambda: _threads(openai_stream, http_url, PROMPTS)}
    threads = [threading.Thread(target=lambda k=k, f=f: got.__setitem__(k, f())) for k, f in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    reference, tok = demo_generate.reference_model(models_dir), Tokenizer()
    from tgw.workers.demo_generator import END, check_against_reference
    rows, failed = [], False
    print(f"\n{MODEL} on the other faces: {len(PROMPTS)} prompts each over gRPC (tritonclient stream), HTTP "
          f"generate_stream (SSE) and the openai client, all {3 * len(PROMPTS)} at once in {elapsed:.2f} s:")
    for face in jobs:
        results = got[face]
        for prompt, r in zip(PROMPTS, results):
            if "error" not in r:
                # the face does not say why a stream ended: an end token, or the output cap
                reason = "max_outputs" if len(r["tokens"]) >= MAX_OUTPUTS else "stop_token"
                r["verdict"] = check_against_reference(reference, tok.encode(prompt), r["tokens"], end_tokens=(END,),
                                                       reason=reason, max_outputs=MAX_OUTPUTS)
        for prompt, r in list(zip(PROMPTS, results))[:2]:
            print(f"  {face:<8} {prompt + tok.decode(r['tokens'])!r}")
        row, bad = demo_generate.summary(face, results, [r["first_ms"] for r in results if "first_ms" in r], elapsed)
        rows.append(row)
        failed |= bad
    return rows, failed


# ---- the sequence model over three faces ----------------------------------------------------------

def _flags(k: int, n: int) -> dict:
    return {"sequence_start": k == 0, "sequence_end": k == n - 1}


def sequences_native(address: str, base: int) -> list[list[int]]:
    with Client(address) as c:
        return _interleave(lambda sid, v, k, n: int(c.infer(
            SEQUENCE_MODEL, {"INPUT": np.array([[v]], np.int32)}, sequence_id=sid, **_flags(k, n),
            timeout=30)["OUTPUT"].reshape(-1)[0]), base)


def sequences_triton(module, url: str, base: int) -> list[list[int]]:
    client = module.InferenceServerClient(url)
    try:
        def step(sid, v, k, n):
            x = module.InferInput("INPUT", [1, 1], "INT32")
            x.set_data_from_numpy(np.array([[v]], np.int32))
            return int(client.infer(SEQUENCE_MODEL, [x], sequence_id=sid, **_flags(k, n)).as_numpy("OUTPUT")
                       .reshape(-1)[0])
        return _interleave(step, base)
    finally:
        client.close()


def _interleave(step, base: int) -> list[list[int]]:
    """The two sequences' steps, alternating; each answer as it came."""
    answers: list[list[int]] = [[] for _ in STEPS]
    for k in range(max(map(len, STEPS))):
        for s, values in enumerate(STEPS):
            if k < len(values):
                answers[s].append(step(base + s, values[k], k, len(values)))
    return answers


def sequences_on_faces(address: str, http_url: str, grpc_url: str) -> tuple[list[tuple], bool]:
    import tritonclient.grpc as tg
    import tritonclient.http as th
    want = [np.cumsum(v).tolist() for v in STEPS]
    faces = {"native": lambda: sequences_native(address, 1000),
             "HTTP": lambda: sequences_triton(th, http_url.split("//", 1)[1], 2000),
             "gRPC": lambda: sequences_triton(tg, grpc_url, 3000)}
    rows, failed = [], False
    print(f"\n{SEQUENCE_MODEL} (Triton-style sequence model, implicit state): two interleaved sequences per face, "
          "start/middle/end flags; each answer must be the running sum:")
    for face, run in faces.items():
        try:
            got, error = run(), None
        except TgwError as err:
            got, error = [], f"{err.code.name}: {err}"
        except Exception as exc:   # a client's own exception type (tritonclient's)
            got, error = [], f"{type(exc).__name__}: {exc}"
        ok = error is None and got == want
        failed |= not ok
        print(f"  {face:<7} {got if error is None else error}  {'ok' if ok else 'WRONG, want ' + str(want)}")
        rows.append((face, sum(map(len, STEPS)), ok))
    return rows, failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", required=True)
    ap.add_argument("--models-dir", required=True)
    args = ap.parse_args()
    with Client(args.address) as c:
        status = c.status()
    http_url, grpc_url = status["http"], status["grpc"]
    rows, failed = generate_on_faces(http_url, grpc_url, args.models_dir)
    demo_generate.show(rows)
    _, seq_failed = sequences_on_faces(args.address, http_url, grpc_url)
    print("RESULT:", "FAIL" if failed or seq_failed else "OK")
    return 1 if failed or seq_failed else 0


if __name__ == "__main__":
    sys.exit(main())
