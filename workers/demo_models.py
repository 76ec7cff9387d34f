"""The embedded demo's TorchScript models, generated locally (nothing is downloaded).

`python -m tgw.workers.demo_models DIR` writes them; the broker runs that in a subprocess so
it never imports torch itself. Weights come from a fixed seed, so every build is identical.
"""
from __future__ import annotations

import io
import json
import os
import sys

import torch
from torch import nn

DEMO_VERSION = "1"


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    def __init__(self, ch: int, stride: int) -> None:
        super().__init__()
        out = ch * stride
        self.conv1 = nn.Conv2d(ch, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.skip = nn.Sequential(nn.Conv2d(ch, out, 1, stride, bias=False), nn.BatchNorm2d(out)) if stride > 1 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))


class SmallResNet(nn.Module):
    """ResNet-style CNN: float32 [B,3,H,W] -> [B,1000] logits (global pooling, any H,W >= 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.Sequential(Block(16, 1), Block(16, 2), Block(32, 2), Block(64, 2))
        self.head = nn.Linear(128, 1000)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        y = self.blocks(self.stem(image))
        return self.head(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(y, 1), 1))


class TokenEmbed(nn.Module):
    """int64 token ids [B, T] (T variable) -> float32 [B, 32] mean embedding, plus lengths."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 32)

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        ids = torch.remainder(tokens, 1000)
        return {"embedding": self.emb(ids).mean(dim=1), "length": torch.full_like(tokens[:, 0], tokens.shape[1])}


# name -> (module factory, example inputs, io declaration as it goes in the config)
DEMO_MODELS = {
    "mlp": (MLP, lambda: (torch.randn(2, 256),), {
        "inputs": [{"name": "x", "dtype": "float32", "shape": [256]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": [10]}],
        "max_batch_size": 64}),
    "resnet": (SmallResNet, lambda: (torch.randn(2, 3, 64, 64),), {
        "inputs": [{"name": "image", "dtype": "float32", "shape": [3, 64, 64]}],
        "outputs": [{"name": "logits", "dtype": "float32", "shape": [1000]}],
        "max_batch_size": 32}),
    "embed": (TokenEmbed, lambda: (torch.randint(0, 1000, (2, 7)),), {
        "inputs": [{"name": "tokens", "dtype": "int64", "shape": [-1]}],
        "outputs": [{"name": "embedding", "dtype": "float32", "shape": [32]},
                    {"name": "length", "dtype": "int64", "shape": []}],
        "max_batch_size": 32}),
}


def build_module(name: str) -> torch.jit.ScriptModule:
    factory = DEMO_MODELS[name][0]
    torch.manual_seed(1234)
    module = factory().eval()
    return torch.jit.script(module)


def build_demo_models(out_dir: str) -> dict[str, str]:
    """Write every demo model (skipping ones already there); returns name -> path."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for name in DEMO_MODELS:
        path = os.path.join(out_dir, f"{name}-v{DEMO_VERSION}.pt")
        if not os.path.exists(path):
            data = io.BytesIO()
            torch.jit.save(build_module(name), data)  # in memory: no temp name inside the archive
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(data.getvalue())
            os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
        paths[name] = path
    return paths


if __name__ == "__main__":
    out = sys.argv[1]
    paths = build_demo_models(out)
    print(json.dumps({name: {"path": paths[name], **DEMO_MODELS[name][2]} for name in DEMO_MODELS}))
