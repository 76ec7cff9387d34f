"""The LitServe baseline of `tgw-bench generate` (gen_baselines.LitServeServer starts it):
`python -m tgw.bench.harness.gen_litserve PORT WORKERS MAX_BATCH`, the weights file in
$TGW_BENCH_GEN_MODEL.

`LitAPI(stream=True)` on the model's own KV-cache loop (gen_model.prefill/step), statically
batched: up to MAX_BATCH requests collected for at most `batch_timeout`, prefilled together, then
stepped to their end before the next batch starts (LitServe's batched streaming loop; its
continuous batching needs the user to write step/add_request/has_capacity, which this baseline
does not). WORKERS workers on the CPU, one torch thread each. POST /predict {"prompt": [ids],
"max_outputs": n} streams one JSON line per output: {"output": id}. Imports litserve: only for
a checkout with the `bench-litserve` extra.
"""
from __future__ import annotations

import sys

import litserve as ls
import torch
from fastapi import HTTPException   # what LitServe answers a bad request with

from tgw.bench.harness import gen_model
from tgw.bench.harness.gen_baselines import bad_request, model_from_env


class GPTStream(ls.LitAPI):
    def __init__(self, max_batch: int):
        super().__init__(stream=True, max_batch_size=max_batch, batch_timeout=0.005)
        self.max_batch = max_batch

    def setup(self, device):
        self.module = model_from_env()
        self.kv = gen_model.kv_pool(self.module, self.max_batch)

    def decode_request(self, request):
        problem = bad_request(request, self.module.cfg.max_len)
        if not problem and request.get("max_outputs", gen_model.OUTPUTS) != gen_model.OUTPUTS:
            problem = f"this server's batches run {gen_model.OUTPUTS} outputs: max_outputs must be that"
        if problem:
            raise HTTPException(400, problem)
        return request["prompt"]

    def predict(self, x):
        # a static batch: every prompt prefilled, then batched steps to its end, one list of
        # outputs a step (max_batch 1: LitServe's unbatched loop, one output a step)
        prompts = x if self.max_batch > 1 else [x]
        with torch.inference_mode():
            first = gen_model.prefill(self.module, prompts, self.kv)
            yield first if self.max_batch > 1 else first[0]
            last, pos = torch.tensor(first), torch.tensor([len(p) for p in prompts])
            for _ in range(gen_model.OUTPUTS - 1):
                last = gen_model.step(self.module, last, self.kv[:len(prompts)], pos)
                pos += 1
                yield last.tolist() if self.max_batch > 1 else int(last[0])

    def encode_response(self, outputs):
        for out in outputs:   # batched: one list of the batch's outputs a step
            yield [{"output": t} for t in out] if isinstance(out, list) else {"output": out}


def main() -> None:
    port, workers, max_batch = map(int, sys.argv[1:4])
    server = ls.LitServer(GPTStream(max_batch), accelerator="cpu", workers_per_device=workers, timeout=600)
    server.run(host="127.0.0.1", port=port, log_level="warning", generate_client_file=False)


if __name__ == "__main__":
    main()
