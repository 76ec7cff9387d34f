"""Tiny TorchScript models the integration tests serve (built in fixtures, never downloaded)."""
from __future__ import annotations

import torch
from torch import nn


class Mixed(nn.Module):
    """float16, bool and variable-length int64 inputs; a tuple of three outputs."""

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor):
        return a * 2 + 1, torch.logical_not(b), c.sum(dim=1)


class Fails(nn.Module):
    """Raises on a negative first element - a model bug the worker must survive."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x[0, 0] < 0):
            raise ValueError("negative input rejected by model")
        return x + 1


class Spin(nn.Module):
    """Computes for a time set by its input (x[0,0] rounds of a 256x256 matmul) - for queueing tests."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.ones(256, 256) / 256.0
        m = torch.ones(256, 256)
        for _ in range(int(x[0, 0].item())):
            m = m @ w
        return x + m[0, 0]


class Double(nn.Module):
    """Output as large as the input: fills small output arenas, exercising block release."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Wide(nn.Module):
    """A large fixed-size output: each row is x repeated 65536 times (256 KiB of float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, 65536)


class Grow(nn.Module):
    """An output whose width (a -1 dim) the caller sets: each row is its x[:, 0] repeated
    max(x[:, 1]) times, so its size is known only after compute."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :1].repeat(1, int(x[:, 1].max().item()))


class WrongDtype(nn.Module):
    """Declared float32 out, returns float64: start-up must fail naming the model."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double()


MODELS = {
    "mixed": (Mixed, {
        "inputs": [{"name": "a", "dtype": "float16", "shape": [4]},
                   {"name": "b", "dtype": "bool", "shape": [3]},
                   {"name": "c", "dtype": "int64", "shape": [-1]}],
        "outputs": [{"name": "a2", "dtype": "float16", "shape": [4]},
                    {"name": "nb", "dtype": "bool", "shape": [3]},
                    {"name": "csum", "dtype": "int64", "shape": []}]}),
    "fails": (Fails, {
        "inputs": [{"name": "x", "dtype": "float32", "shape": [2]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": [2]}]}),
    "spin": (Spin, {
        "inputs": [{"name": "x", "dtype": "float32", "shape": [1]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": [1]}]}),
    "double": (Double, {
        "inputs": [{"name": "x", "dtype": "float32", "shape": [-1]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": [-1]}]}),
    "wide": (Wide, {
        "inputs": [{"name": "x", "dtype": "float32", "shape": [1]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": [65536]}]}),
    "grow": (Grow, {
        "inputs": [{"name": "x", "dtype": "float32", "shape": [2]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": [-1]}]}),
    "wrongdtype": (WrongDtype, {
        "inputs": [{"name": "x", "dtype": "float32", "shape": [2]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": [2]}]}),
}


def save(name: str, path: str) -> None:
    torch.jit.script(MODELS[name][0]()).save(path)
