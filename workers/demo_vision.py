"""The demo `classify` pipeline's stages and data: DecodeImage (JPEG bytes -> the demo resnet's
normalised float32 [3, 64, 64]) and TopK (logits -> top-5 labels and softmax scores); the
synthetic JPEGs the demo traffic and the bench send, and the 1000 labels, all made locally.

How DecodeImage decodes was measured (the retired decode_choice bench, bench/results/decode_choice.json,
mean decode + resize of the demo images on one core): simplejpeg with its DCT-domain downscale to
no less than 64x64, then one Pillow resize, 163 us; Pillow in draft mode 251 us; Pillow 375 us
(torchvision was not installed). Pillow's draft mode is the fallback where simplejpeg is missing.
"""
from __future__ import annotations

import importlib.util
import io
import os
from typing import Callable

import numpy as np
import torch

SIZE = 64                                               # the demo resnet's input: [3, 64, 64]
MEAN = np.array([0.485, 0.456, 0.406], np.float32)      # ImageNet's, as torchvision's resnets take
STD = np.array([0.229, 0.224, 0.225], np.float32)
IMAGE_SIZES = [(96, 80), (128, 96), (160, 120), (200, 150), (240, 180), (256, 256), (288, 216), (320, 240)]
WORDS = ("tench goldfish shark ray cock hen ostrich finch robin jay magpie eagle vulture owl newt frog turtle "
         "lizard snake crab lobster heron crane pelican penguin whale dog wolf fox cat lion tiger bear ant bee "
         "beetle butterfly rabbit hamster zebra pig ox sheep goat bison camel ape monkey panda eel salmon").split()


def label_lines(count: int = 1000) -> list[str]:
    """The demo's labels: "class-000 tench", "class-001 goldfish", ... (words reused, numbered)."""
    return [f"class-{i:03d} {WORDS[i % len(WORDS)]}" for i in range(count)]


def draw_image(index: int, width: int, height: int) -> bytes:
    """A synthetic JPEG: a gradient background with a few shapes, different for every index."""
    from PIL import Image, ImageDraw
    rng = np.random.default_rng(index)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(0, 255, 3)
    slope = rng.uniform(-1.0, 1.0, (3, 2))
    pixels = np.stack([base[c] + slope[c, 0] * x + slope[c, 1] * y for c in range(3)], axis=-1)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(3 + index % 4):
        x0, y0 = int(rng.integers(0, width - 8)), int(rng.integers(0, height - 8))
        box = (x0, y0, x0 + int(rng.integers(8, width // 2)), y0 + int(rng.integers(8, height // 2)))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=color)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90)
    return out.getvalue()


def write_images(folder: str) -> list[str]:
    """The demo's JPEGs (IMAGE_SIZES, 96x80 to 320x240) in `folder`; their paths."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for i, (w, h) in enumerate(IMAGE_SIZES):
        path = os.path.join(folder, f"image-{i}-{w}x{h}.jpg")
        if not os.path.exists(path):
            with open(path + ".tmp", "wb") as f:
                f.write(draw_image(i, w, h))
            os.replace(path + ".tmp", path)
        paths.append(path)
    return paths


# ---- decoders: JPEG bytes -> uint8 [64, 64, 3] (decode_choice.json times each) ----------------

def decode_pillow(data: bytes) -> np.ndarray:
    from PIL import Image
    with Image.open(io.BytesIO(data)) as image:
        if image.format != "JPEG":
            raise ValueError(f"a {image.format} file, not a JPEG")
        return np.asarray(image.convert("RGB").resize((SIZE, SIZE), Image.BILINEAR))


def decode_pillow_draft(data: bytes) -> np.ndarray:
    """Pillow, letting libjpeg scale down by 1/2, 1/4 or 1/8 while decoding (draft mode)."""
    from PIL import Image
    with Image.open(io.BytesIO(data)) as image:
        if image.format != "JPEG":
            raise ValueError(f"a {image.format} file, not a JPEG")
        image.draft("RGB", (SIZE, SIZE))
        return np.asarray(image.convert("RGB").resize((SIZE, SIZE), Image.BILINEAR))


def decode_simplejpeg(data: bytes) -> np.ndarray:
    """simplejpeg (libjpeg-turbo), scaled down in the DCT to no less than 64x64, then resized."""
    import simplejpeg
    from PIL import Image
    pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=SIZE, min_height=SIZE)
    return np.asarray(Image.fromarray(pixels).resize((SIZE, SIZE), Image.BILINEAR))


def decode_torchvision(data: bytes) -> np.ndarray:
    import torchvision
    image = torchvision.io.decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    small = torch.nn.functional.interpolate(image[None].float(), size=(SIZE, SIZE), mode="bilinear",
                                            antialias=True, align_corners=False)
    return small[0].round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()


DECODERS: dict[str, Callable[[bytes], np.ndarray]] = {
    "pillow": decode_pillow, "pillow-draft": decode_pillow_draft, "simplejpeg": decode_simplejpeg,
    "torchvision": decode_torchvision}
CHOSEN = "simplejpeg"    # the fastest measured (bench/results/decode_choice.json)


def chosen_decoder() -> Callable[[bytes], np.ndarray]:
    """The measured fastest, or Pillow's draft-mode decode where simplejpeg is not installed."""
    return DECODERS[CHOSEN] if importlib.util.find_spec("simplejpeg") else decode_pillow_draft


def normalise(pixels: np.ndarray) -> np.ndarray:
    """uint8 [64, 64, 3] -> float32 [3, 64, 64], scaled to 0..1 then by ImageNet's mean and std."""
    return ((pixels.astype(np.float32) / 255.0 - MEAN) / STD).transpose(2, 0, 1)


class DecodeImage:
    """bytes JPEG [] -> pixels float32 [3, 64, 64]. A row that is not a decodable JPEG fails alone."""

    def setup(self, context) -> None:
        self.decode = chosen_decoder()

    def __call__(self, batch) -> dict:
        out = np.zeros((batch.rows, 3, SIZE, SIZE), np.float32)
        for row, data in enumerate(batch["image"]):
            try:
                out[row] = normalise(self.decode(data))
            except Exception as exc:  # noqa: BLE001 - every decoder's error means a bad file
                batch.fail(row, f"not a decodable JPEG: {type(exc).__name__}: {exc}"[:300])
        return {"pixels": out}


class TopK:
    """logits float32 [1000] -> labels bytes [k] and scores float32 [k] (softmax), best first.
    options: labels (a file of one label a line, as many lines as logits), k (default 5)."""

    def setup(self, context) -> None:
        path = context.options.get("labels")
        if not path:
            raise ValueError(f"stage {context.name}: options.labels (the labels file) is missing")
        with open(path, encoding="utf-8") as f:
            self.labels = [line.rstrip("\n").encode() for line in f if line.strip()]
        self.k = int(context.options.get("k", 5))

    def __call__(self, batch) -> dict:
        logits = torch.as_tensor(batch["logits"], dtype=torch.float32)
        if logits.shape[-1] != len(self.labels):
            raise ValueError(f"logits have {logits.shape[-1]} classes, the labels file {len(self.labels)}")
        scores, index = torch.softmax(logits, dim=-1).topk(self.k, dim=-1)
        return {"labels": [[self.labels[i] for i in row] for row in index.tolist()], "scores": scores.contiguous()}
