"""The demo pipelines run in one process, batched: the same stage classes (tgw.workers.demo_stages)
and the same model files, loaded as the worker loads them (`load_in_process`). scripts/demo_traffic.py
checks every served answer against these, and the retired pipeline bench's floor row ran them.

    classify:   image bytes -> DecodeImage -> resnet -> TopK -> labels bytes [5], scores float32 [5]
    embed-text: text bytes  -> Tokenize    -> embed  -> L2Normalize -> embedding float32 [32]
"""
from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np
import torch

from tgw.workers.demo_stages import LABELS_FILE, TOKENIZER_FILE, DecodeImage, L2Normalize, Tokenize, TopK
from tgw.workers.stage import StageBatch, StageContext


def ready_stage(cls: type, name: str, **options) -> Any:
    """An instance of stage `cls` after its setup(context) and warmup(), as a worker prepares it."""
    stage = cls()
    stage.setup(StageContext(name=name, version="1", dir="", device=torch.device("cpu"), threads=1, options=options))
    getattr(stage, "warmup", lambda: None)()
    return stage


def run_stage(stage: Any, inputs: dict[str, Any], rows: int) -> tuple[dict[str, Any], dict[int, str]]:
    """One batch through `stage`: (its outputs, the rows it failed: row -> message)."""
    batch = StageBatch(rows, torch.device("cpu"), inputs)
    out = stage(batch)
    return out, batch.failed


def _numpy(x: Any) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


class DemoPipelines:
    """Both demo pipelines over the files of the demo folder `folder` (models and data built)."""

    def __init__(self, folder: str, resnet: Optional[str] = None, embed: Optional[str] = None):
        from tgw.workers.demo_models import demo_file
        from tgw.workers.formats import load_in_process
        self.decode = ready_stage(DecodeImage, "decode-image")
        self.top5 = ready_stage(TopK, "top5", labels=os.path.join(folder, LABELS_FILE), k=5)
        self.tokenize = ready_stage(Tokenize, "tokenize", tokenizer=os.path.join(folder, TOKENIZER_FILE))
        self.normalize = ready_stage(L2Normalize, "l2-normalize")
        self.resnet = load_in_process("torchscript", resnet or demo_file(folder, "resnet", "torchscript")).call
        self.embed = load_in_process("torchscript", embed or demo_file(folder, "embed", "torchscript")).call

    @torch.inference_mode()
    def classify(self, images: list[bytes]) -> list[dict[str, Any]]:
        """One batch of JPEGs; per image {labels: [5 bytes], scores: float32 [5]} or {error: message}."""
        pixels, failed = run_stage(self.decode, {"image": list(images)}, len(images))
        logits = self.resnet(torch.from_numpy(_numpy(pixels["pixels"])))
        top, failed_top = run_stage(self.top5, {"logits": logits}, len(images))
        scores = _numpy(top["scores"])
        failed = {**failed_top, **failed}
        return [{"error": failed[i]} if i in failed else {"labels": top["labels"][i], "scores": scores[i]}
                for i in range(len(images))]

    @torch.inference_mode()
    def embed_text(self, texts: list[bytes]) -> list[dict[str, Any]]:
        """One batch of UTF-8 texts; per text {embedding: float32 [32]} or {error: message}."""
        tokens, failed = run_stage(self.tokenize, {"text": list(texts)}, len(texts))
        vectors = self.embed(torch.from_numpy(_numpy(tokens["tokens"])))["embedding"]
        out, _ = run_stage(self.normalize, {"vector": vectors}, len(texts))
        embedding = _numpy(out["embedding"])
        return [{"error": failed[i]} if i in failed else {"embedding": embedding[i]} for i in range(len(texts))]

    def run(self, pipeline: str, items: list[bytes], batch: int = 32) -> list[dict[str, Any]]:
        """`pipeline` (classify or embed-text) over `items` in batches of up to `batch`."""
        step = {"classify": self.classify, "embed-text": self.embed_text}[pipeline]
        return [r for i in range(0, len(items), batch) for r in step(items[i:i + batch])]
