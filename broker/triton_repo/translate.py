"""A Triton model (its ModelConfig and folder) as tgw entries: a model, a stage or a pipeline,
and whatever its file asks that tgw does not honour."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from tgw.broker.faces.grpc.proto import model_config_pb2 as mc

from . import ensemble, scheduling, tensors, versions as policy
from .notes import Notes
from .parse import ConfigFileError, as_dict, read_config

# platform/backend -> what tgw makes of it
KINDS = {("pytorch_libtorch", ""): "torchscript", ("", "pytorch"): "torchscript",
         ("pytorch_libtorch", "pytorch"): "torchscript",
         ("onnxruntime_onnx", ""): "onnx", ("", "onnxruntime"): "onnx", ("onnxruntime_onnx", "onnxruntime"): "onnx",
         ("", "python"): "python", ("ensemble", ""): "ensemble"}
DEFAULT_FILE = {"torchscript": "model.pt", "onnx": "model.onnx", "python": "model.py"}
MAX_BATCH = 4096   # ModelDecl.max_batch_size's bound
# fields translated (or checked) by the code below; any other one set is named in the warning
HANDLED = {"name", "platform", "backend", "version_policy", "max_batch_size", "input", "output",
           "dynamic_batching", "sequence_batching", "ensemble_scheduling", "instance_group",
           "default_model_filename", "parameters", "model_warmup", "model_transaction_policy", "response_cache",
           "batch_input", "batch_output"}
# known backend parameters: tgw runs the file with its own settings
BACKEND_PARAMETERS = {"DISABLE_OPTIMIZED_EXECUTION", "INFERENCE_MODE", "ENABLE_NVFUSER", "ENABLE_JIT_EXECUTOR",
                      "ENABLE_JIT_PROFILING", "ENABLE_TENSOR_FUSER", "ENABLE_WEIGHT_SHARING", "ENABLE_CACHE_CLEANING",
                      "INTER_OP_THREAD_COUNT", "INTRA_OP_THREAD_COUNT", "intra_op_thread_count",
                      "inter_op_thread_count", "execution_mode", "cudnn_conv_algo_search",
                      "enable_mem_arena", "enable_mem_pattern", "memory.enable_memory_arena_shrinkage",
                      "EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS"}


@dataclass
class Translation:
    models: list[dict] = field(default_factory=list)      # ModelDecl-shaped
    pipelines: list[dict] = field(default_factory=list)   # PipelineDecl-shaped
    warnings: list[str] = field(default_factory=list)     # one per model at most
    refusals: list[str] = field(default_factory=list)     # "model M: field F: why"

    def add(self, other: "Translation") -> None:
        self.models += other.models
        self.pipelines += other.pipelines
        self.warnings += other.warnings
        self.refusals += other.refusals


def translate_repository(directory: str) -> Translation:
    """Every model folder of a Triton repository (a folder holding config.pbtxt, or a folder beside
    them without one: refused, naming the missing file), in name order."""
    out = Translation()
    root = os.path.abspath(directory)
    try:
        names = sorted(n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n)) and not n.startswith("."))
    except OSError as exc:
        out.refusals.append(f"model repository {root}: cannot be read: {exc.strerror}")
        return out
    if not names:
        out.refusals.append(f"model repository {root}: holds no model folder (<model>/config.pbtxt)")
    for name in names:
        model_dir = os.path.join(root, name)
        try:
            config = read_config(model_dir)
        except ConfigFileError as exc:
            out.refusals.append(f"model {name}: {exc}")
            continue
        out.add(translate_model(config, model_dir))
    nested(out)
    return out


def nested(out: Translation) -> None:
    """An ensemble whose step is another ensemble is refused (a pipeline's step is a model or a
    stage), named here rather than left to the pipelines' check with a key path never written."""
    names = {p["name"] for p in out.pipelines}
    for p in [p for p in out.pipelines if any(s["model"] in names for s in p["steps"])]:
        inner = sorted({s["model"] for s in p["steps"] if s["model"] in names})
        out.refusals.append(f"model {p['name']}: ensemble_scheduling: steps on ensembles {inner}: a pipeline's step "
                            "is a model or a stage; list the inner ensemble's steps in this one")
        out.pipelines.remove(p)


def translate_model(config: mc.ModelConfig, model_dir: str, versions: list[str] | None = None) -> Translation:
    """One model: its entry (a model, stage or pipeline), its warning and its refusals. `versions`
    (folder names) replaces what version_policy picks."""
    model_dir = os.path.abspath(model_dir)
    name = os.path.basename(model_dir.rstrip("/"))
    notes = Notes(name)
    out = Translation()
    if config.name and config.name != name:
        notes.refuse("name", f"{config.name!r} is not the folder's name {name!r} (Triton requires they match)")
    kind = KINDS.get((config.platform, config.backend))
    if kind is None:
        notes.refuse("platform" if config.platform else "backend",
                     f"{config.platform or config.backend or '(none)'}: tgw serves pytorch_libtorch, onnxruntime_onnx, "
                     "the python backend and ensembles (an unset platform and backend is not auto-completed)")
        out.refusals = notes.refusals
        return out
    unknown = sorted(f.name for f, _ in config.ListFields() if f.name not in HANDLED)
    for f in unknown:
        notes.warn(f, "backend- or server-specific: not tgw's")
    if kind == "ensemble":
        pipeline = ensemble.pipeline(config, name, policy.folders(model_dir), notes)
        out.pipelines = [pipeline] if pipeline else []
    else:
        decl = model(config, kind, model_dir, name, versions, notes)
        out.models = [decl] if decl else []
    out.warnings, out.refusals = notes.warning(), notes.refusals
    if out.refusals:
        out.models, out.pipelines = [], []
    return out


def model(config, kind: str, model_dir: str, name: str, versions: list[str] | None, notes: Notes) -> dict | None:
    is_stage = kind == "python"
    if config.batch_input or config.batch_output:
        notes.refuse("batch_input/batch_output", "tensors Triton derives from the batch are not tgw's")
    if config.ensemble_scheduling.step:
        notes.refuse("ensemble_scheduling", f"only platform ensemble has steps (this is {kind})")
    if config.max_batch_size < 0:
        notes.refuse("max_batch_size", f"{config.max_batch_size}: 0 (no batch dimension) or more")
    decl: dict = {"name": name, "max_batch_size": min(config.max_batch_size, MAX_BATCH)}
    if config.max_batch_size > MAX_BATCH:
        notes.warn("max_batch_size", f"{config.max_batch_size} capped at tgw's {MAX_BATCH}")
    decl["inputs"] = [tensors.tensor(t, "input", model_dir, notes) for t in config.input]
    decl["outputs"] = [tensors.tensor(t, "output", model_dir, notes) for t in config.output]
    for what in ("input", "output"):
        if not decl[f"{what}s"]:
            notes.refuse(what, f"none declared: tgw does not auto-complete a config (declare each {what} in "
                         "config.pbtxt)")
    # a sequence model's worker orders every fed tensor (controls and states too) itself
    if kind == "torchscript" and not config.HasField("sequence_batching"):
        for what in ("inputs", "outputs"):
            problem = tensors.indexed_problem(decl[what])
            if problem:
                notes.refuse(what[:-1], problem)
            decl[what] = tensors.positional(decl[what])
        if len(decl["inputs"]) > 1 and not all(tensors.INDEXED.match(t["name"]) for t in decl["inputs"]):
            notes.warn("input names", "not all NAME__N: passed to forward in config.pbtxt's order, not matched to "
                       "its argument names (list them in forward's order)")
    chosen = versions if versions is not None else policy.chosen(config, model_dir, notes)
    filename = config.default_model_filename or DEFAULT_FILE[kind]
    if config.cc_model_filenames:
        notes.warn("cc_model_filenames", f"every device loads {filename}")
    decl["versions"] = []
    for v in chosen:
        path = os.path.join(model_dir, v, filename)
        if not os.path.isfile(path):
            notes.refuse(f"version {v}", f"{path} not found (the {kind} file of this version)")
        elif is_stage:
            decl["versions"].append({"version": v, "handler": f"{path}:TritonPythonModel"})
        else:
            decl["versions"].append({"version": v, "path": path, "format": kind})
    if chosen:
        decl["default_version"] = chosen[-1]   # Triton answers the highest version when none is named
    parameters(config, decl, notes, is_stage)
    if is_stage:
        decl.setdefault("options", {})["triton_model_config"] = as_dict(config)
    if config.HasField("dynamic_batching"):
        scheduling.dynamic_batching(config.dynamic_batching, decl, notes)
    if config.HasField("sequence_batching"):
        scheduling.sequence_batching(config, decl, notes, is_stage)
    scheduling.instance_group(config, decl, notes, is_stage)
    scheduling.warmup(config, decl, notes, is_stage)
    scheduling.transaction_and_cache(config, decl, notes, is_stage)
    return decl


def parameters(config, decl: dict, notes: Notes, is_stage: bool) -> None:
    """A stage gets each parameter's string_value as an option (its config too); a model file has
    no options: the backend's own parameters are named in the warning."""
    known = sorted(k for k in config.parameters if k in BACKEND_PARAMETERS)
    if known:
        notes.warn(f"parameters {', '.join(known)}", "the backend's settings: tgw runs the file with its own")
    if is_stage:
        decl["options"] = {k: p.string_value for k, p in config.parameters.items() if k not in BACKEND_PARAMETERS}
        return
    rest = sorted(k for k in config.parameters if k not in BACKEND_PARAMETERS)
    if rest:
        notes.warn(f"parameters {', '.join(rest)}", "a model file takes no options")
