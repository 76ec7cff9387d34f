"""TorchServe model archives (.mar) built at run time with the real `torch-model-archiver` CLI,
for the tests and `tgw-bench torchserve` alike (nothing downloaded, nothing committed):

* `text_archive`: TorchServe's built-in `text_classifier` handler as its users meet it - an eager
  model (`--model-file model.py`, one class with an `embedding` EmbeddingBag, as the handler's
  captum set-up wants) with its state dict, `source_vocab.pt` (a plain dict token -> index, which
  `torch.load` reads with weights_only) and `index_to_name.json` as extra files;
* `image_archive`: a custom `BaseHandler` subclass (`image_handler.py`) decoding each request's
  JPEG or PNG with Pillow into a 32x32 RGB tensor, a tiny CNN saved as TorchScript (no model
  file: BaseHandler's `torch.jit.load` path), batched, top-3 classes by name per request.

Batching and workers, when asked, go into the archive's model-config.yaml (`--config-file`),
which TorchServe and tgw both read: one archive, the same settings on both servers.

The vocabulary covers every word and bigram of `SENTENCES` (the built-in handler indexes its
vocabulary with `[]`, so an unknown token is a KeyError in TorchServe as in tgw): send those.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from typing import Optional

TEXT_CLASSES = ("World", "Sports", "Business", "Sci/Tech")
IMAGE_CLASSES = ("cat", "dog", "bird", "car", "ship", "plane", "horse", "truck")
SENTENCES = (
    "the team won the final match of the season",
    "stocks fell as the market opened on monday",
    "new chip makes phones faster and cheaper",
    "leaders met to talk about the peace deal",
)
EMBED_DIM = 32
IMAGE_SIZE = 32

TEXT_MODEL_PY = f'''"""The tiny text classifier of tgw's TorchServe archives (TorchServe's text example's shape)."""
import torch.nn as nn


class TextClassificationModel(nn.Module):
    def __init__(self, vocab_size={{vocab_size}}, embed_dim={EMBED_DIM}, num_class={len(TEXT_CLASSES)}):
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocab_size, embed_dim)
        self.fc = nn.Linear(embed_dim, num_class)

    def forward(self, text, offsets):
        return self.fc(self.embedding(text, offsets))
'''

IMAGE_HANDLER_PY = f'''"""A custom TorchServe handler: each request's JPEG or PNG decoded with Pillow, classified in one batch."""
import base64
import io

import numpy as np
import torch
from PIL import Image
from ts.torch_handler.base_handler import BaseHandler


class PillowImageClassifier(BaseHandler):
    size = {IMAGE_SIZE}
    topk = 3

    def preprocess(self, data):
        images = []
        for row in data:
            raw = row.get("data") or row.get("body")
            if isinstance(raw, str):   # a JSON or form field: base64, as TorchServe's vision handler takes it
                raw = base64.b64decode(raw)
            image = Image.open(io.BytesIO(raw)).convert("RGB").resize((self.size, self.size))
            images.append(torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1))
        return torch.stack(images).to(self.device)

    def postprocess(self, data):
        probs, classes = torch.softmax(data, dim=1).topk(self.topk, dim=1)
        return [{{(self.mapping or {{}}).get(str(c), str(c)): p for p, c in zip(ps, cs)}}
                for ps, cs in zip(probs.tolist(), classes.tolist())]
'''


def archiver() -> str:
    """The `torch-model-archiver` CLI: beside this Python's executable (a venv's bin/), else on $PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "torch-model-archiver")
    found = here if os.access(here, os.X_OK) else shutil.which("torch-model-archiver")
    if not found:
        raise FileNotFoundError("torch-model-archiver not found: pip install torch-model-archiver==0.12.0 "
                                "(tgw's `bench` extra has it)")
    return found


def model_config(work: str, batch_size: Optional[int], max_batch_delay_ms: Optional[int],
                 workers: Optional[int]) -> Optional[str]:
    """The archive's model-config.yaml (torch-model-archiver --config-file; TorchServe and tgw
    both read its batchSize, maxBatchDelay, minWorkers/maxWorkers), or None when nothing is asked."""
    cfg = {k: v for k, v in (("batchSize", batch_size), ("maxBatchDelay", max_batch_delay_ms),
                             ("minWorkers", workers), ("maxWorkers", workers)) if v is not None}
    if not cfg:
        return None
    with open(os.path.join(work, "model-config.yaml"), "w") as f:
        f.write("".join(f"{k}: {v}\n" for k, v in cfg.items()))
    return "model-config.yaml"


def _archive(work: str, export: str, name: str, handler: str, serialized: str, model_file: Optional[str],
             extra: list[str], config_file: Optional[str] = None) -> str:
    os.makedirs(export, exist_ok=True)
    argv = [archiver(), "--model-name", name, "--version", "1.0", "--serialized-file", serialized,
            "--handler", handler, "--export-path", export, "--force"]
    if config_file:
        argv += ["--config-file", config_file]
    if model_file:
        argv += ["--model-file", model_file]
    if extra:
        argv += ["--extra-files", ",".join(extra)]
    proc = subprocess.run(argv, cwd=work, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"torch-model-archiver failed ({proc.returncode}): {proc.stderr.strip()[-1500:]}")
    return os.path.join(export, f"{name}.mar")


def vocabulary() -> dict[str, int]:
    """Every word and bigram of SENTENCES (as the built-in handler tokenizes them), index 0 `<unk>`."""
    vocab = {"<unk>": 0}
    for s in SENTENCES:
        words = s.split()
        for tok in words + [" ".join(p) for p in zip(words, words[1:])]:
            vocab.setdefault(tok, len(vocab))
    return vocab


def _labels(path: str, names: tuple[str, ...]) -> str:
    with open(path, "w") as f:
        json.dump({str(i): n for i, n in enumerate(names)}, f)
    return path


def text_archive(export: str, name: str = "textclf", seed: int = 0, workers: Optional[int] = None) -> str:
    """A .mar for TorchServe's built-in `text_classifier` in folder `export`; returns its path.
    `workers`: minWorkers = maxWorkers in its model-config.yaml (batchSize 1: the handler reads
    only a batch's first request)."""
    import torch
    work = os.path.join(export, f".{name}-src")
    os.makedirs(work, exist_ok=True)
    vocab = vocabulary()
    with open(os.path.join(work, "model.py"), "w") as f:
        f.write(TEXT_MODEL_PY.replace("{vocab_size}", str(len(vocab))))
    torch.manual_seed(seed)
    model = torch.nn.Module()   # the state dict of model.py's class, made without importing it
    model.embedding = torch.nn.EmbeddingBag(len(vocab), EMBED_DIM)
    model.fc = torch.nn.Linear(EMBED_DIM, len(TEXT_CLASSES))
    torch.save(model.state_dict(), os.path.join(work, "model.pt"))
    torch.save(vocab, os.path.join(work, "source_vocab.pt"))
    _labels(os.path.join(work, "index_to_name.json"), TEXT_CLASSES)
    return _archive(work, export, name, "text_classifier", "model.pt", "model.py",
                    ["source_vocab.pt", "index_to_name.json"],
                    model_config(work, 1 if workers else None, None, workers))


def image_archive(export: str, name: str = "imgclf", seed: int = 0, batch_size: Optional[int] = None,
                  max_batch_delay_ms: Optional[int] = None, workers: Optional[int] = None) -> str:
    """A .mar with the custom Pillow handler and a TorchScript CNN in folder `export`; returns its
    path. batch_size, max_batch_delay_ms, workers: its model-config.yaml (none: no such file)."""
    import torch
    from torch import nn
    work = os.path.join(export, f".{name}-src")
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "image_handler.py"), "w") as f:
        f.write(IMAGE_HANDLER_PY)
    torch.manual_seed(seed)
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(16, len(IMAGE_CLASSES))).eval()
    torch.jit.save(torch.jit.script(cnn), os.path.join(work, "model.pt"))
    _labels(os.path.join(work, "index_to_name.json"), IMAGE_CLASSES)
    return _archive(work, export, name, "image_handler.py", "model.pt", None, ["index_to_name.json"],
                    model_config(work, batch_size, max_batch_delay_ms, workers))


def sample_image(fmt: str = "JPEG", size: int = 64, seed: int = 0) -> bytes:
    """A seeded noise image of size x size pixels, encoded as JPEG or PNG: a request's body."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def reference_text(archive_src: str, sentence: str) -> dict[str, float]:
    """What the built-in handler answers for `sentence` (unigrams and bigrams, softmax, by class
    name), computed from the archive's own files (its source folder beside the .mar) without ts."""
    import torch
    state = torch.load(os.path.join(archive_src, "model.pt"))
    vocab = torch.load(os.path.join(archive_src, "source_vocab.pt"))
    words = sentence.lower().split()
    ids = torch.as_tensor([vocab[t] for t in words + [" ".join(p) for p in zip(words, words[1:])]])
    bag = torch.nn.EmbeddingBag(len(vocab), EMBED_DIM)
    fc = torch.nn.Linear(EMBED_DIM, len(TEXT_CLASSES))
    bag.load_state_dict({"weight": state["embedding.weight"]})
    fc.load_state_dict({"weight": state["fc.weight"], "bias": state["fc.bias"]})
    with torch.no_grad():
        probs = torch.softmax(fc(bag(ids, torch.as_tensor([0]))), dim=1)[0].tolist()
    return dict(zip(TEXT_CLASSES, probs))
