"""The embedded demo's stages, as the config names them (`handler: tgw.workers.demo_stages:Class`),
and the data they read, built locally into the demo folder (nothing is downloaded):

    DecodeImage  image bytes (JPEG) []   -> pixels float32 [3, 64, 64]           (demo_vision.py)
    TopK         logits float32 [1000]   -> labels bytes [5], scores float32 [5]  (demo_vision.py)
    Tokenize     text bytes (UTF-8) []   -> tokens int64 [16]                     (demo_text.py)
    L2Normalize  vector float32 [32]     -> embedding float32 [32], unit length   (demo_text.py)
    Sleep        x float32 [n]           -> x, after options.ms milliseconds      (the bench's 5 ms stage)

`demo_stage_decls(folder)` is each stage's declaration as the demo config takes it; their files
(labels.txt, tokenizer.json) reach setup() through `options`. `python -m tgw.workers.demo_models
DIR --stages` prints them with the models, so the broker builds its demo config without torch.
"""
from __future__ import annotations

import base64
import os
import time

from tgw.workers.demo_text import TOKENS, L2Normalize, Tokenize, train_tokenizer
from tgw.workers.demo_vision import SIZE, DecodeImage, TopK, label_lines, write_images

__all__ = ["DecodeImage", "TopK", "Tokenize", "L2Normalize", "Sleep", "build_demo_data", "demo_stage_decls"]

LABELS_FILE, TOKENIZER_FILE, IMAGES_DIR = "labels.txt", "tokenizer.json", "images"


class Sleep:
    """Passes x through after sleeping options.ms (default 5) milliseconds per batch: a
    pre-processing stage of known cost that leaves the cores to the rest (the retired pipeline bench)."""

    def setup(self, context) -> None:
        self.seconds = float(context.options.get("ms", 5)) / 1e3

    def __call__(self, batch) -> dict:
        time.sleep(self.seconds)
        return {"x": batch["x"]}


def build_demo_data(folder: str) -> dict:
    """labels.txt (1000 labels), tokenizer.json (trained on demo_corpus.CORPUS) and images/
    (synthetic JPEGs) in `folder`, each kept when already there; {labels, tokenizer, images}."""
    os.makedirs(folder, exist_ok=True)
    labels = os.path.join(folder, LABELS_FILE)
    if not os.path.exists(labels):
        with open(labels + ".tmp", "w", encoding="utf-8") as f:
            f.write("\n".join(label_lines()) + "\n")
        os.replace(labels + ".tmp", labels)
    return {"labels": labels, "tokenizer": train_tokenizer(os.path.join(folder, TOKENIZER_FILE)),
            "images": write_images(os.path.join(folder, IMAGES_DIR))}


def _decl(cls: type, inputs: list, outputs: list, max_batch_size: int, warmup: list, **options) -> dict:
    return {"handler": f"{__name__}:{cls.__name__}", "device": "cpu", "options": options,
            "inputs": inputs, "outputs": outputs, "max_batch_size": max_batch_size, "warmup_inputs": warmup}


def demo_stage_decls(folder: str) -> dict:
    """name -> {handler, device, options, inputs, outputs, max_batch_size}: the demo's stages,
    their data built in `folder` first."""
    data = build_demo_data(folder)
    with open(data["images"][0], "rb") as f:   # the smallest image: each stage is tried once before it serves
        image = base64.b64encode(f.read()).decode()
    return {
        "decode-image": _decl(DecodeImage, [{"name": "image", "dtype": "bytes", "shape": []}],
                              [{"name": "pixels", "dtype": "float32", "shape": [3, SIZE, SIZE]}], 32,
                              [{"image": {"base64": image}}]),
        "top5": _decl(TopK, [{"name": "logits", "dtype": "float32", "shape": [1000]}],
                      [{"name": "labels", "dtype": "bytes", "shape": [5]},
                       {"name": "scores", "dtype": "float32", "shape": [5]}], 32, [{"logits": "zeros"}],
                      labels=data["labels"], k=5),
        "tokenize": _decl(Tokenize, [{"name": "text", "dtype": "bytes", "shape": []}],
                          [{"name": "tokens", "dtype": "int64", "shape": [TOKENS]}], 32,
                          [{"text": "a cat sat on the mat"}], tokenizer=data["tokenizer"], length=TOKENS),
        "l2-normalize": _decl(L2Normalize, [{"name": "vector", "dtype": "float32", "shape": [32]}],
                              [{"name": "embedding", "dtype": "float32", "shape": [32]}], 32,
                              [{"vector": [1.0] * 32}]),
    }
