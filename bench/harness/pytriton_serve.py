"""PyTriton serving a stand-in repository's ensemble as one Python function (`tgw-bench
triton-ensemble`'s baseline). Run by that scenario in PyTriton's own environment (nvidia-pytriton,
torch, numpy; tgw is not imported):

    python pytriton_serve.py REPO HTTP_PORT GRPC_PORT METRICS_PORT MODEL_NAME

It binds the same code the Triton repository's Python models hold - `preprocess` and
`postprocess`, module-level functions of REPO/preprocess/1/model.py and REPO/postprocess/1/model.py,
imported as they are (triton_python_backend_utils, which they import, is a stand-in here: PyTriton
never calls their TritonPythonModel) - around the TorchScript file REPO/classifier/1/model.pt, with
PyTriton's @batch and Triton's dynamic batcher as the repository's configs ask (max_batch_size 64,
max_queue_delay_microseconds 500). Prints READY when it answers; stops on SIGTERM.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import sys
import threading
import types


def load(path: str, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(repo: str, http_port: int, grpc_port: int, metrics_port: int, model_name: str) -> None:
    import numpy as np
    import torch
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    sys.modules.setdefault("triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    pre = load(os.path.join(repo, "preprocess", "1", "model.py"), "pre_model")
    post = load(os.path.join(repo, "postprocess", "1", "model.py"), "post_model")
    torch.set_num_threads(1)   # as a tgw worker's threads_per_worker: 1
    net = torch.jit.load(os.path.join(repo, "classifier", "1", "model.pt")).eval()
    side = pre.SIDE

    @batch
    def infer(IMAGE):
        with torch.inference_mode():
            scores = net(torch.from_numpy(pre.preprocess(IMAGE))).numpy()
        labels, probs = post.postprocess(scores)
        return {"LABEL": labels, "PROBABILITY": probs}

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    config = TritonConfig(http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port)
    with Triton(config=config) as triton:
        triton.bind(model_name=model_name, infer_func=infer,
                    inputs=[Tensor(name="IMAGE", dtype=np.uint8, shape=(side * side * 3,))],
                    outputs=[Tensor(name="LABEL", dtype=bytes, shape=(1,)),
                             Tensor(name="PROBABILITY", dtype=np.float32, shape=(1,))],
                    config=ModelConfig(max_batch_size=64,
                                       batcher=DynamicBatcher(max_queue_delay_microseconds=500)))
        triton.run()
        print("READY", flush=True)
        stop.wait()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
