"""A Triton model repository of stand-in models, written at run time (tests/process/test_triton_examples.py
runs Triton's own client examples against it; bench/scenarios/triton_ensemble.py serves its ensemble).

Each model is what Triton's examples expect of the model of that name (Triton's QA repository
builds them from C++ custom backends; these are TorchScript or Python-backend stand-ins with the
same names, tensors and answers):

| model | platform | what it does |
|---|---|---|
| `simple` | pytorch_libtorch | INPUT0, INPUT1 int32 [16] -> OUTPUT0 = sum, OUTPUT1 = difference |
| `simple_string` | python | the same on BYTES tensors holding decimal integers |
| `simple_identity` | python | BYTES INPUT0 [-1] -> OUTPUT0, the same bytes |
| `simple_sequence` | pytorch_libtorch | sequence batching: INPUT int32 [1] -> OUTPUT = INPUT, + 1 on a sequence's first request (the START control) |
| `image_cnn` | pytorch_libtorch | FORMAT_NCHW FP32 [3,16,16] -> [4] scores, labels.txt (classification) |
| `image_cnn_flat` | pytorch_libtorch | max_batch_size 0, FORMAT_NHWC [16,16,3] -> [4] scores, labels.txt |
| `image_decode`, `image_ensemble` | python, ensemble | a JPEG file's bytes (BYTES [1]) decoded with Pillow, then `image_cnn`: ensemble_image_client.py's model |
| `preprocess`, `classifier`, `postprocess`, `ensemble_classify` | python, pytorch_libtorch, python, ensemble | UINT8 image [IMAGE_BYTES] -> top label BYTES [1] and its score FP32 [1] |

`write(root)` lays them out (ROOT/NAME/config.pbtxt, ROOT/NAME/1/model.pt|model.py) and returns
the names; `write(root, only=ENSEMBLE_MODELS)` writes the ensemble's four alone. The ensemble's
pre- and post-processing are module-level numpy functions of their model.py files (`preprocess`,
`postprocess`), so a server other than Triton's (PyTriton, in the bench) can bind the same code.
"""
from __future__ import annotations

import os

import numpy as np

CLASSES = ["cat", "dog", "fox", "owl"]
SIDE = 16                          # the image models' height and width
IMAGE_BYTES = SIDE * SIDE * 3      # the ensemble's input: an RGB image, flattened uint8
ENSEMBLE_MODELS = ("preprocess", "classifier", "postprocess", "ensemble_classify")

SIMPLE_CONFIG = """\
name: "simple"
platform: "pytorch_libtorch"
max_batch_size: 8
input [
  { name: "INPUT0", data_type: TYPE_INT32, dims: [ 16 ] },
  { name: "INPUT1", data_type: TYPE_INT32, dims: [ 16 ] }
]
output [
  { name: "OUTPUT0", data_type: TYPE_INT32, dims: [ 16 ] },
  { name: "OUTPUT1", data_type: TYPE_INT32, dims: [ 16 ] }
]
"""

SIMPLE_STRING_CONFIG = """\
name: "simple_string"
backend: "python"
max_batch_size: 8
input [
  { name: "INPUT0", data_type: TYPE_STRING, dims: [ 16 ] },
  { name: "INPUT1", data_type: TYPE_STRING, dims: [ 16 ] }
]
output [
  { name: "OUTPUT0", data_type: TYPE_STRING, dims: [ 16 ] },
  { name: "OUTPUT1", data_type: TYPE_STRING, dims: [ 16 ] }
]
"""

SIMPLE_STRING = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """BYTES tensors of decimal integers: their sum and difference, as BYTES."""

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy().astype(np.int64)
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy().astype(np.int64)
            text = np.vectorize(lambda v: str(v).encode("utf-8"), otypes=[object])
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", text(a + b)),
                                                         pb_utils.Tensor("OUTPUT1", text(a - b))]))
        return responses
'''

SIMPLE_IDENTITY_CONFIG = """\
name: "simple_identity"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0", data_type: TYPE_STRING, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_STRING, dims: [ -1 ] } ]
"""

SIMPLE_IDENTITY = '''\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
                for r in requests]
'''

SIMPLE_SEQUENCE_CONFIG = """\
name: "simple_sequence"
platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUTPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  control_input [
    { name: "START", control [ { kind: CONTROL_SEQUENCE_START, int32_false_true: [ 0, 1 ] } ] }
  ]
}
"""

IMAGE_CONFIG = """\
name: "{name}"
platform: "pytorch_libtorch"
max_batch_size: {max_batch_size}
input [ {{ name: "INPUT__0", data_type: TYPE_FP32, format: {format}, dims: [ {dims} ] }} ]
output [ {{ name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4 ], label_filename: "labels.txt" }} ]
"""

PREPROCESS_CONFIG = f"""\
name: "preprocess"
backend: "python"
max_batch_size: 64
input [ {{ name: "IMAGE", data_type: TYPE_UINT8, dims: [ {IMAGE_BYTES} ] }} ]
output [ {{ name: "PIXELS", data_type: TYPE_FP32, dims: [ 3, {SIDE}, {SIDE} ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 500 }}
"""

PREPROCESS = f'''\
import numpy as np
import triton_python_backend_utils as pb_utils

SIDE = {SIDE}
MEAN = np.array([123.7, 116.3, 103.5], np.float32).reshape(1, 3, 1, 1)
STD = np.array([58.4, 57.1, 57.4], np.float32).reshape(1, 3, 1, 1)


def preprocess(images: np.ndarray) -> np.ndarray:
    """[N, SIDE*SIDE*3] uint8 HWC images -> [N, 3, SIDE, SIDE] float32, normalised per channel."""
    chw = images.reshape(-1, SIDE, SIDE, 3).transpose(0, 3, 1, 2).astype(np.float32)
    return np.ascontiguousarray((chw - MEAN) / STD)


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
                    "PIXELS", preprocess(pb_utils.get_input_tensor_by_name(r, "IMAGE").as_numpy()))])
                for r in requests]
'''

CLASSIFIER_CONFIG = f"""\
name: "classifier"
platform: "pytorch_libtorch"
max_batch_size: 64
input [ {{ name: "INPUT__0", data_type: TYPE_FP32, dims: [ 3, {SIDE}, {SIDE} ] }} ]
output [ {{ name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 500 }}
"""

POSTPROCESS_CONFIG = """\
name: "postprocess"
backend: "python"
max_batch_size: 64
input [ { name: "SCORES", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [
  { name: "LABEL", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "PROBABILITY", data_type: TYPE_FP32, dims: [ 1 ] }
]
dynamic_batching { max_queue_delay_microseconds: 500 }
"""

POSTPROCESS = f'''\
import numpy as np
import triton_python_backend_utils as pb_utils

CLASSES = {CLASSES!r}


def postprocess(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, 4] scores -> the top class's label [N, 1] (bytes) and its softmax probability [N, 1]."""
    e = np.exp(scores - scores.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    top = p.argmax(axis=1)
    labels = np.array([CLASSES[k].encode() for k in top], dtype=object).reshape(-1, 1)
    return labels, p[np.arange(len(top)), top].astype(np.float32).reshape(-1, 1)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for r in requests:
            labels, probs = postprocess(pb_utils.get_input_tensor_by_name(r, "SCORES").as_numpy())
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("LABEL", labels),
                                                         pb_utils.Tensor("PROBABILITY", probs)]))
        return responses
'''

ENSEMBLE_CONFIG = f"""\
name: "ensemble_classify"
platform: "ensemble"
max_batch_size: 64
input [ {{ name: "IMAGE", data_type: TYPE_UINT8, dims: [ {IMAGE_BYTES} ] }} ]
output [
  {{ name: "LABEL", data_type: TYPE_STRING, dims: [ 1 ] }},
  {{ name: "PROBABILITY", data_type: TYPE_FP32, dims: [ 1 ] }}
]
ensemble_scheduling {{
  step [
    {{ model_name: "preprocess", model_version: -1,
      input_map {{ key: "IMAGE" value: "IMAGE" }}, output_map {{ key: "PIXELS" value: "pixels" }} }},
    {{ model_name: "classifier", model_version: -1,
      input_map {{ key: "INPUT__0" value: "pixels" }}, output_map {{ key: "OUTPUT__0" value: "scores" }} }},
    {{ model_name: "postprocess", model_version: -1,
      input_map {{ key: "SCORES" value: "scores" }},
      output_map [ {{ key: "LABEL" value: "LABEL" }}, {{ key: "PROBABILITY" value: "PROBABILITY" }} ] }}
  ]
}}
"""


IMAGE_DECODE_CONFIG = f"""\
name: "image_decode"
backend: "python"
max_batch_size: 8
input [ {{ name: "ENCODED", data_type: TYPE_STRING, dims: [ 1 ] }} ]
output [ {{ name: "PIXELS", data_type: TYPE_FP32, dims: [ 3, {SIDE}, {SIDE} ] }} ]
"""

IMAGE_DECODE = f'''\
import io

import numpy as np
import triton_python_backend_utils as pb_utils
from PIL import Image


def decode(blob: bytes) -> np.ndarray:
    """An encoded image -> [3, {SIDE}, {SIDE}] float32 in [-1, 1] (INCEPTION scaling), RGB, CHW."""
    img = Image.open(io.BytesIO(blob)).convert("RGB").resize(({SIDE}, {SIDE}), Image.BILINEAR)
    return (np.asarray(img, np.float32) / 127.5 - 1).transpose(2, 0, 1)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for r in requests:
            blobs = pb_utils.get_input_tensor_by_name(r, "ENCODED").as_numpy()
            pixels = np.stack([decode(b[0]) for b in blobs])
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PIXELS", pixels)]))
        return responses
'''

IMAGE_ENSEMBLE_CONFIG = """\
name: "image_ensemble"
platform: "ensemble"
max_batch_size: 8
input [ { name: "INPUT", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "SCORES", data_type: TYPE_FP32, dims: [ 4 ], label_filename: "labels.txt" } ]
ensemble_scheduling {
  step [
    { model_name: "image_decode", model_version: -1,
      input_map { key: "ENCODED" value: "INPUT" }, output_map { key: "PIXELS" value: "pixels" } },
    { model_name: "image_cnn", model_version: -1,
      input_map { key: "INPUT__0" value: "pixels" }, output_map { key: "OUTPUT__0" value: "SCORES" } }
  ]
}
"""


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _torchscript(module, path: str) -> None:
    import torch
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.jit.save(torch.jit.script(module.eval()), path)


def _simple_module():
    import torch

    class Simple(torch.nn.Module):
        def forward(self, INPUT0: torch.Tensor, INPUT1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return INPUT0 + INPUT1, INPUT0 - INPUT1
    return Simple()


def _sequence_module():
    import torch

    class Sequence(torch.nn.Module):
        def forward(self, INPUT: torch.Tensor, START: torch.Tensor) -> torch.Tensor:
            return INPUT + START
    return Sequence()


def _cnn(channels_last: bool):
    """A tiny CNN, seeded: 3 x SIDE x SIDE -> 4 scores; with `channels_last` it takes HWC."""
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self, hwc: bool):
            super().__init__()
            self.hwc = hwc
            self.conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
            self.head = torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.hwc:
                x = x.permute(0, 3, 1, 2) if x.dim() == 4 else x.permute(2, 0, 1)
            flat = x.dim() == 3          # max_batch_size 0: one image, no batch dim
            if flat:
                x = x.unsqueeze(0)
            y = self.head(torch.relu(self.conv(x)).mean(dim=(2, 3)))
            return y.squeeze(0) if flat else y
    torch.manual_seed(0)
    return Tiny(channels_last)


def write(root: str, only: tuple[str, ...] | None = None) -> list[str]:
    """The stand-in models (or `only` those) written under `root`; their names."""
    labels = "".join(f"{c}\n" for c in CLASSES)
    models = {
        "simple": lambda d: (_write(f"{d}/config.pbtxt", SIMPLE_CONFIG), _torchscript(_simple_module(), f"{d}/1/model.pt")),
        "simple_string": lambda d: (_write(f"{d}/config.pbtxt", SIMPLE_STRING_CONFIG),
                                    _write(f"{d}/1/model.py", SIMPLE_STRING)),
        "simple_identity": lambda d: (_write(f"{d}/config.pbtxt", SIMPLE_IDENTITY_CONFIG),
                                      _write(f"{d}/1/model.py", SIMPLE_IDENTITY)),
        "simple_sequence": lambda d: (_write(f"{d}/config.pbtxt", SIMPLE_SEQUENCE_CONFIG),
                                      _torchscript(_sequence_module(), f"{d}/1/model.pt")),
        "image_cnn": lambda d: (_write(f"{d}/config.pbtxt", IMAGE_CONFIG.format(
                                    name="image_cnn", max_batch_size=8, format="FORMAT_NCHW", dims=f"3, {SIDE}, {SIDE}")),
                                _write(f"{d}/labels.txt", labels), _torchscript(_cnn(False), f"{d}/1/model.pt")),
        "image_cnn_flat": lambda d: (_write(f"{d}/config.pbtxt", IMAGE_CONFIG.format(
                                         name="image_cnn_flat", max_batch_size=0, format="FORMAT_NHWC",
                                         dims=f"{SIDE}, {SIDE}, 3")),
                                     _write(f"{d}/labels.txt", labels), _torchscript(_cnn(True), f"{d}/1/model.pt")),
        "image_decode": lambda d: (_write(f"{d}/config.pbtxt", IMAGE_DECODE_CONFIG),
                                   _write(f"{d}/1/model.py", IMAGE_DECODE)),
        "image_ensemble": lambda d: (_write(f"{d}/config.pbtxt", IMAGE_ENSEMBLE_CONFIG),
                                     _write(f"{d}/labels.txt", labels), os.makedirs(f"{d}/1", exist_ok=True)),
        "preprocess": lambda d: (_write(f"{d}/config.pbtxt", PREPROCESS_CONFIG), _write(f"{d}/1/model.py", PREPROCESS)),
        "classifier": lambda d: (_write(f"{d}/config.pbtxt", CLASSIFIER_CONFIG),
                                 _torchscript(_cnn(False), f"{d}/1/model.pt")),
        "postprocess": lambda d: (_write(f"{d}/config.pbtxt", POSTPROCESS_CONFIG),
                                  _write(f"{d}/1/model.py", POSTPROCESS)),
        "ensemble_classify": lambda d: (_write(f"{d}/config.pbtxt", ENSEMBLE_CONFIG), os.makedirs(f"{d}/1", exist_ok=True)),
    }
    names = list(only or models)
    for name in names:
        models[name](os.path.join(root, name))
    return names


def image(path: str, seed: int = 0) -> str:
    """A small RGB JPEG at `path` (image_client.py's input), made with Pillow."""
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    Image.fromarray(pixels, "RGB").save(path, "JPEG")
    return path


def images(n: int, seed: int = 0) -> np.ndarray:
    """`n` random flattened uint8 images, the ensemble's input rows [n, IMAGE_BYTES]."""
    return np.random.default_rng(seed).integers(0, 256, (n, IMAGE_BYTES), dtype=np.uint8)
