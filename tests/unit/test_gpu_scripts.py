"""scripts/gpu-check.sh and scripts/gpu-wheels.sh, read without a GPU: the wheels gpu-wheels.sh
downloads, with the packages the GPU image already holds, cover every import of the tgw packages
and of the GPU tests, and every requirement of those wheels; gpu-check.sh links the folders
pyproject.toml maps. (The scripts run - they parse, gpu-check.sh's verdict, the GPU bench's
--help: tests/process/test_gpu_check.py.)"""
from __future__ import annotations

import ast
import glob
import os
import re
import sys
import tomllib
from importlib import metadata

from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK, WHEELS = (os.path.join(ROOT, "scripts", name) for name in ("gpu-check.sh", "gpu-wheels.sh"))

# The GPU image's Python packages (/work/.library/device/KINDS.md, "Python packages already there",
# as read on a machine running it on 2026-11-17).
DEVICE_PACKAGES = """absl-py, accelerate, aiofiles, aiohappyeyeballs, aiohttp, aiosignal, annotated-doc, anyio,
attrs, botorch, build, certifi, charset-normalizer, chex, click, cloudpickle, cmake, colorama, contourpy, coverage,
cuda-bindings, cuda-core, cuda-pathfinder, cuda-toolkit, cupy-cuda13x, cycler, cython, diffrax, e3nn, einops,
equinox, etils, execnet, filelock, flatbuffers, flax, fonttools, formulaic, frozenlist, fsspec, gpytorch, grpcio,
h11, h5py, hf-xet, httpcore, httpx, huggingface-hub, humanize, hypothesis, idna, imageio, iniconfig,
interface-meta, jax, jax-cuda13-pjrt, jax-cuda13-plugin, jaxlib, jaxtyping, jinja2, joblib, kiwisolver,
lazy-loader, lightning, lightning-utilities, linear-operator, lineax, llvmlite, lxml, markdown, markdown-it-py,
markupsafe, matplotlib, mdurl, meson, ml-dtypes, mpi4py, mpmath, msgpack, multidict, multipledispatch,
mypy-extensions, nanobind, narwhals, networkx, ninja, numba, numba-cuda, numpy, numpyro, nvidia-cublas,
nvidia-cuda-cupti, nvidia-cuda-nvrtc, nvidia-cuda-runtime, nvidia-cudnn-cu13, nvidia-cufft, nvidia-cufile,
nvidia-curand, nvidia-cusolver, nvidia-cusparse, nvidia-cusparselt-cu13, nvidia-ml-py, nvidia-nccl-cu13,
nvidia-nvjitlink, nvidia-nvshmem-cu13, nvidia-nvtx, onnx, onnx-ir, onnxruntime, onnxscript, opencv-python-headless,
optax, opt-einsum, opt-einsum-fx, optimistix, orbax-checkpoint, packaging, pandas, pathspec, patsy, peft, pillow,
pip, pluggy, portalocker, prometheus-client, propcache, protobuf, psutil, pyarrow, pybind11, py-cpuinfo, pygments,
pyparsing, pyproject-hooks, pyre-extensions, pytest, pytest-benchmark, pytest-cov, pytest-mock, pytest-timeout,
pytest-xdist, python-dateutil, pytorch-lightning, pyyaml, regex, requests, rich, sacrebleu, safetensors,
scikit-build-core, scikit-image, scikit-learn, scipy, seaborn, sentencepiece, sentence-transformers, setuptools,
shellingham, simplejson, six, sortedcontainers, statsmodels, sympy, tabulate, tensorboard,
tensorboard-data-server, tensorstore, threadpoolctl, tifffile, tiktoken, timm, tokenizers, toolz, torch,
torchaudio, torchdiffeq, torch-geometric, torchmetrics, torchvision, tqdm, transformers, treescope, triton, typer,
typing-extensions, typing-inspect, urllib3, uvloop, wadler-lindig, werkzeug, wheel, wrapt, xarray, xxhash, yarl,
zipp"""

# imported by the tgw packages but never on the GPU run: tracing (the [tracing] extra) loads
# opentelemetry only when a config turns it on, which no GPU test or the GPU bench does
# imported by nothing the GPU run executes: tracing's exporter, and the demo's stages (their image
# and text libraries; torchvision's decoder is used only where it imports)
# litserve and fastapi: the generate bench's LitServe row, an optional extra (bench-litserve) whose
# absence the row records; openai and tritonclient: the clients `tgw-bench generate-faces` drives
# the faces with (bench/harness/face_drive.py, imported when that scenario runs, never on the GPU run)
NOT_ON_THE_GPU_RUN = {"opentelemetry", "PIL", "simplejpeg", "tokenizers", "torchvision", "litserve", "fastapi",
                      "openai", "tritonclient", "ts",   # ts: TorchServe archives, not on the GPU run
                      "pytriton"}   # bench/harness/pytriton_serve.py runs in PyTriton's own venv, never on the GPU run
# run, not imported: the GPU bench's Flask row is `python -m gunicorn`
RUN_AS_COMMANDS = {"gunicorn"}
MUST_CARRY = ("pyzmq", "msgspec", "lz4", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
              "setproctitle", "orjson", "flask", "blinker", "itsdangerous", "gunicorn")
TGW_DIRS = ("broker", "workers", "shm", "client", "bench")
MARKERS = {"extra": "", "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
           "platform_machine": "x86_64", "os_name": "posix"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def carried() -> list[str]:
    """The names in gpu-wheels.sh's PACKAGES=( ... ) array, comments dropped."""
    with open(WHEELS) as f:
        block = re.search(r"^PACKAGES=\((.*?)^\)", f.read(), re.M | re.S)
    assert block, "no PACKAGES=( ... ) array in scripts/gpu-wheels.sh"
    return [w for line in block.group(1).splitlines() for w in line.split("#", 1)[0].split()]


def device() -> set[str]:
    names = {norm(n.strip()) for n in DEVICE_PACKAGES.split(",")}
    assert len(names) > 150 and {"torch", "numpy", "psutil", "pyyaml", "uvloop"} <= names
    return names


def gpu_test_files() -> list[str]:
    """As gpu-check.sh picks them: the test files that mark tests gpu."""
    out = []
    tests = os.path.join(ROOT, "tests")
    for path in sorted(glob.glob(os.path.join(tests, "*.py")) + glob.glob(os.path.join(tests, "*", "*.py"))):
        with open(path) as f:
            if re.search(r"pytest\.mark\.gpu\b", f.read()):
                out.append(path)
    return out


def third_party_imports(paths: list[str]) -> dict[str, set[str]]:
    """Top-level module -> files, for every import statement (function-level ones too) that names
    neither the standard library, tgw, nor a module of this repository's tests or root."""
    local = {os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "tests", "**", "*.py"),
                                                                          recursive=True)}
    local |= {"tgw", *TGW_DIRS, *(d for d in os.listdir(os.path.join(ROOT, "tests")))}
    found: dict[str, set[str]] = {}
    for path in paths:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local:
                    found.setdefault(top, set()).add(os.path.relpath(path, ROOT))
    return found


def test_the_wheels_and_the_image_cover_the_gpu_run():
    wheels, image = {norm(n) for n in carried()}, device()
    assert not [n for n in MUST_CARRY if n not in wheels], f"gpu-wheels.sh lacks some of {MUST_CARRY}: {sorted(wheels)}"
    sources = [p for d in TGW_DIRS for p in glob.glob(os.path.join(ROOT, d, "**", "*.py"), recursive=True)]
    assert os.path.join(ROOT, "bench", "scenarios", "gpu.py") in sources
    tests = gpu_test_files()
    assert {os.path.basename(p) for p in tests} >= {"test_gpu.py", "test_cuda_ipc.py"}
    imports = third_party_imports(sources + [os.path.join(ROOT, "tests", n) for n in ("conftest.py", "models.py")]
                                  + tests)
    assert {"zmq", "msgspec", "lz4", "pydantic", "setproctitle", "orjson", "flask", "torch"} <= set(imports)
    dists = metadata.packages_distributions()
    unknown = {m: sorted(f) for m, f in imports.items() if m not in dists and m not in NOT_ON_THE_GPU_RUN}
    assert not unknown, f"imported, but installed by no distribution here: {unknown}"
    needed = {norm(d) for m, ds in dists.items() if m in imports and m not in NOT_ON_THE_GPU_RUN for d in ds}
    missing = sorted((needed | RUN_AS_COMMANDS) - wheels - image)
    assert not missing, f"the GPU run needs {missing}: neither in the GPU image nor in gpu-wheels.sh's PACKAGES"


def test_each_wheel_finds_its_requirements():
    wheels, image = {norm(n) for n in carried()}, device()
    for name in carried():
        for text in metadata.requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(MARKERS):
                assert norm(req.name) in wheels | image, f"{name} needs {req}: carry it in gpu-wheels.sh"


def test_gpu_check_imports_and_links_what_pyproject_maps():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    with open(CHECK) as f:
        script = f.read()
    links = re.search(r"for link in ([\w=/ ]+); do", script)
    assert links and mapping == {f"tgw.{name}": d for name, d in (pair.split("=") for pair in links.group(1).split())}
    assert "setup-venv" not in script.replace("never scripts/setup-venv.sh", "")
    needed = re.search(r'^NEEDED="([^"]+)"', script, re.M).group(1).split()
    dists = metadata.packages_distributions()
    wheels = {norm(n) for n in carried()}
    for module in needed:   # each module the script checks comes from a carried wheel
        assert {norm(d) for d in dists[module.split(".")[0]]} & wheels, module


def test_gpu_check_fronts_sweep_is_a_valid_faces_run():
    """The fronts sweep (issue 43) as gpu-check.sh runs it: `tgw-bench faces` over 0, 1, 2, 4 and 8
    fronts and every face, accepted by the scenario's own parser, short enough for its timeout."""
    from tgw.bench import cli
    with open(CHECK) as f:
        script = f.read()
    args = re.search(r"^FACES_ARGS=\$\{TGW_FACES_ARGS:-(.+)\}$", script, re.M).group(1).split()
    a = cli.parser("tgw-bench").parse_args(["faces", *args])
    assert a.fronts == [0, 1, 2, 4, 8] and a.faces == ["native", "http", "grpc", "grpc-stream"] and a.no_c1
    timeout = int(re.search(r'"\$\{TGW_FACES_TIMEOUT:-(\d+)\}"', script).group(1))
    # per broker: its start (about 10 s) and four rows of warm-up + window + the generator's start (about 2 s)
    assert 5 * (10 + 4 * a.rounds * (a.duration + a.warmup + 2)) <= timeout <= 180
    assert re.search(r"tgw\.bench\.cli faces \$FACES_ARGS --json \"\$OUT/faces\.json\"", script)
