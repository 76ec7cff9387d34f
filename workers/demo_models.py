"""The embedded demo's models, generated locally (nothing is downloaded), in each format tgw serves.

`python -m tgw.workers.demo_models DIR` writes them; the broker runs that in a subprocess so
it never imports torch itself. Weights come from a fixed seed, so every build is identical and
`mlp-export` and `mlp-aoti` hold the very weights of `mlp`.

Exporting your own model (`save_model` below does exactly this):

    import torch
    from torch.export import Dim
    model = MyModel().eval()
    example = (torch.randn(4, 256),)             # a batch of >= 2 rows: a batch of 1 would be fixed at 1
    batch = Dim("batch", min=1, max=64)          # max: at least the config's max_batch_size
    shapes = ({0: batch},)                       # one dict per input; a -1 dim also gets a Dim:
                                                 # {0: batch, 1: Dim("tokens", min=1, max=512)}

    # format: torchscript (deprecated by PyTorch, still served)
    torch.jit.save(torch.jit.script(model), "model.pt")
    # format: export -- a torch.export program
    ep = torch.export.export(model, example, dynamic_shapes=shapes)
    torch.export.save(ep, "model.pt2")
    # format: aoti -- AOTInductor: compiled ahead of time (needs a C++ compiler; on a GPU box,
    # export with CUDA example inputs and a CUDA model to get a CUDA package). Compile the
    # program as saved and loaded back, with mkldnn and nnpack off (save_model says why)
    with torch.backends.mkldnn.flags(enabled=False), torch.backends.nnpack.flags(enabled=False):
        torch._inductor.aoti_compile_and_package(torch.export.load("model.pt2"), package_path="model-aoti.pt2")
    # format: onnx -- served through onnxruntime (the `onnx` extra); the dynamo exporter takes the
    # same dynamic_shapes; inputs and outputs are named as the config declares them
    torch.onnx.export(model, example, "model.onnx", dynamo=True, dynamic_shapes=shapes,
                      input_names=["x"], output_names=["y"], external_data=False)

The config then declares the file as usual; `format:` is optional (tgw reads it from the file)
and, when given, must match. The batch Dim's range must cover 1..max_batch_size and the
warm-up sizes, and every dim the config declares -1 must be a Dim in the program: tgw checks
both when the model loads and refuses it, naming the dim, otherwise. One exception: torch may
still compile an AOTInductor package to take no fewer than 2 rows (it specialises sizes 0 and
1); the worker then pads smaller batches up to the package's minimum and drops the padding.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
from typing import Callable

import torch
from torch import nn


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


DEMO_VERSION = "1"
# the same weights in another format: name -> (the model it is made from, format)
FORMAT_MODELS = {"mlp-export": ("mlp", "export"), "mlp-aoti": ("mlp", "aoti")}
SUFFIX = {"torchscript": ".pt", "export": ".pt2", "aoti": ".pt2", "onnx": ".onnx"}
TORCH_TAG = torch.__version__.split("+")[0]   # an AOTInductor build runs only with the torch that built it


def build_module(name: str) -> nn.Module:
    """The eager demo model `name` (mlp, resnet, embed) with its fixed weights."""
    torch.manual_seed(1234)
    return DEMO_MODELS[name][0]().eval()


def demo_file(out_dir: str, base: str, fmt: str) -> str:
    """Where the demo model `base` in format `fmt` is cached."""
    tag = f"-torch{TORCH_TAG}" if fmt == "aoti" else ""
    stem = base if fmt == "torchscript" else f"{base}-{fmt}"
    return os.path.join(out_dir, f"{stem}-v{DEMO_VERSION}{tag}{SUFFIX[fmt]}")


def dynamic_shapes(io_decl: dict, max_batch_size: int) -> tuple:
    """torch.export's dynamic_shapes for a config declaration: a shared batch Dim of
    1..max_batch_size, and a Dim for every -1 dim."""
    batch = torch.export.Dim("batch", min=1, max=max_batch_size)
    return tuple({0: batch, **{k: torch.export.Dim(f"{t['name']}_{k}", min=1, max=4096)
                               for k, d in enumerate(t["shape"], start=1) if d == -1}}
                 for t in io_decl["inputs"])


def save_model(module: nn.Module, example: tuple, path: str, fmt: str, shapes: tuple | None = None,
               names: tuple[list[str], list[str]] | None = None) -> str:
    """Write `module` to `path` in format `fmt` (torchscript, export, aoti or onnx), atomically: a
    reader never sees half a file. `shapes`: torch.export's dynamic_shapes (export, aoti, onnx);
    `names`: an ONNX file's (input names, output names), as the config declares them."""
    tmp = os.path.join(os.path.dirname(path) or ".", f".tmp-{os.getpid()}-{os.path.basename(path)}")
    try:
        if fmt == "torchscript":
            data = io.BytesIO()
            torch.jit.save(torch.jit.script(module), data)  # in memory: no temp name inside the archive
            with open(tmp, "wb") as f:
                f.write(data.getvalue())
        elif fmt == "onnx":   # one file: external data would carry the temporary name
            torch.onnx.export(module, example, tmp, dynamo=True, dynamic_shapes=shapes, external_data=False,
                              input_names=names[0] if names else None, output_names=names[1] if names else None)
        else:
            ep = torch.export.export(module, example, dynamic_shapes=shapes)
            if fmt == "export":
                torch.export.save(ep, tmp)
            else:
                # From the program saved and loaded back, with mkldnn and nnpack off: with torch
                # 2.13 on the CPU, compiled straight from torch.export.export the batch range
                # narrowed to >= 2, and a conv's backend choice for the example batch became
                # guards (the demo resnet's package, from 4 example rows, took only 2..15 rows);
                # both measured. tgw refuses a range short of max_batch_size at load (one that
                # starts at 2 it serves, padding a batch of 1). Compiled this way the range stays
                # 1..max and the package still runs ATen's conv (outputs as eager's at 1, 2, 16
                # and 32 rows); some graphs (a reduction over a row, x.sum(dim=1)) still start at 2.
                saved = io.BytesIO()
                torch.export.save(ep, saved)
                saved.seek(0)
                with torch.backends.mkldnn.flags(enabled=False), torch.backends.nnpack.flags(enabled=False):
                    torch._inductor.aoti_compile_and_package(torch.export.load(saved), package_path=tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def cxx_compiler() -> str | None:
    """The C++ compiler AOTInductor would use ($CXX, else c++, g++ or clang++), if there is one."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next((p for p in map(shutil.which, names) if p), None)


def build_file(out_dir: str, base: str, fmt: str) -> str:
    """The cached file of demo model `base` in format `fmt`, built first if missing."""
    path = demo_file(out_dir, base, fmt)
    if not os.path.exists(path):
        os.makedirs(out_dir, exist_ok=True)
        example = tuple(x.repeat(2, *[1] * (x.dim() - 1)) for x in DEMO_MODELS[base][1]())  # 4 rows
        io_decl = DEMO_MODELS[base][2]
        names = ([t["name"] for t in io_decl["inputs"]], [t["name"] for t in io_decl["outputs"]])
        save_model(build_module(base), example, path, fmt, dynamic_shapes(io_decl, io_decl["max_batch_size"]), names)
    return path


def build_demo_models(out_dir: str, formats: bool = False, log: Callable[[str], None] = lambda line: None) -> dict:
    """Write every demo model (skipping ones already there); name -> {path, format, base}.
    `formats`: FORMAT_MODELS too, the AOTInductor one only where a C++ compiler is found (`log`
    says so otherwise)."""
    os.makedirs(out_dir, exist_ok=True)
    wanted = {name: (name, "torchscript") for name in DEMO_MODELS}
    if formats:
        wanted.update(FORMAT_MODELS)
    built = {}
    for name, (base, fmt) in wanted.items():
        if fmt == "aoti" and not os.path.exists(demo_file(out_dir, base, fmt)) and cxx_compiler() is None:
            log(f"{name}: skipped, no C++ compiler found ($CXX, c++, g++, clang++) to build the AOTInductor package")
            continue
        built[name] = {"path": build_file(out_dir, base, fmt), "format": fmt, "base": base}
    return built


# The embedded demo's generator (tgw.workers.demo_generator): a small GPT trained on the text tgw
# ships for a fixed number of steps (deterministic; ~12 s of one core, once per demo folder: a
# file already there is kept, so name a new file when the weights would change).
GPT_CONFIG = {"vocab": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_len": 256}
GPT_TRAIN_STEPS = 1200
GPT_FILE = f"tiny-gpt-v{DEMO_VERSION}.pt"


# tiny-gpt learnt plain text, no chat turns: a chat is its messages' text, one per line, which the
# model continues (the OpenAI face's /v1/chat/completions, docs/OPENAI.md)
CHAT_TEMPLATE = "{% for m in messages %}{{ m.content }}{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"


def build_generator_decls(out_dir: str, log: Callable[[str], None] = lambda line: None) -> dict:
    """tiny-gpt's weights in `out_dir` (trained first if missing) and its declaration as the demo
    config takes it: name -> {handler, device, options, inputs, outputs, max_batch_size, max_queue,
    generator}."""
    from tgw.workers.demo_generator import END, GPTConfig, build_gpt, kv_shape, save_gpt
    cfg = GPTConfig(**GPT_CONFIG)
    path = os.path.join(out_dir, GPT_FILE)
    if not os.path.exists(path):
        log(f"tiny-gpt: training its weights ({GPT_TRAIN_STEPS} steps on the text tgw ships, once)")
        save_gpt(build_gpt(cfg, seed=1234, train_steps=GPT_TRAIN_STEPS), path)
    return {"tiny-gpt": {
        "handler": "tgw.workers.demo_generator:TinyGPT", "device": "cpu", "options": {"weights": path, "chat_template": CHAT_TEMPLATE},
        "inputs": [{"name": "prompt", "dtype": "int64", "shape": [-1]}],      # token ids (demo_tokenizer)
        "outputs": [{"name": "token", "dtype": "int64", "shape": []}],
        "max_batch_size": 32, "max_queue": 256,
        "warmup_inputs": [{"prompt": [84, 104, 101, 32]}],                    # "The "
        "generator": {"state": [{"name": "kv", "dtype": "float32", "shape": kv_shape(cfg)}],
                      "max_sequences": 32, "max_length": cfg.max_len, "length_input": "prompt",
                      "max_outputs": 200, "end_tokens": [END], "tokenizer": "bytes"}}}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tgw.workers.demo_models", description="write the demo models, "
                                 "print name -> {path, format, inputs, outputs, max_batch_size} as JSON")
    ap.add_argument("dir")
    ap.add_argument("--formats", action="store_true", help=f"also {', '.join(FORMAT_MODELS)} (the same weights as "
                    "export and AOTInductor files; the AOTInductor build takes ~30 s, once)")
    ap.add_argument("--stages", action="store_true", help="also the demo's stages (tgw.workers.demo_stages) and their "
                    "data (labels.txt, tokenizer.json, images/): name -> {handler, device, options, inputs, ...}")
    ap.add_argument("--generators", action="store_true", help="also the demo's generator tiny-gpt (its weights "
                    "trained on text tgw ships, once): name -> {handler, options, ..., generator}")
    ap.add_argument("--sequences", action="store_true", help="also the demo's sequence models (accumulator, "
                    "tiny-rnn: tgw.workers.demo_sequence): name -> {path or handler, ..., sequence_batching}")
    args = ap.parse_args()
    models = build_demo_models(args.dir, args.formats, log=lambda line: print(line, file=sys.stderr))
    served = {name: {**m, **DEMO_MODELS[m["base"]][2]} for name, m in models.items()}
    if args.stages:
        from tgw.workers.demo_stages import demo_stage_decls
        served.update(demo_stage_decls(args.dir))
    if args.generators:
        served.update(build_generator_decls(args.dir, log=lambda line: print(line, file=sys.stderr)))
    if args.sequences:
        from tgw.workers.demo_sequence import build_sequence_decls
        served.update(build_sequence_decls(args.dir))
    print(json.dumps(served))
