"""Triton's model configuration and statistics documents, as its clients parse them.

Plain functions of the broker's state (a model's entry, a pipeline's plan, the counters in
state/stats.py), so any face can serve them: the HTTP face's `/config` and `/stats` as JSON, the
gRPC face's ModelConfig and ModelStatistics as their protobuf mapping (ParseDict).

Triton's clients take versions for integers. A version whose name is a decimal integer is shown
as itself; every other one gets a numeric alias: the smallest positive integer no numeric
version of the model uses and no earlier non-numeric one took, in the order of the model's
versions (as loaded: the config's order, then runtime loads). `/versions/{v}/...` paths take the
name or the alias.

A generator's config shows `model_transaction_policy {decoupled: true}` (it answers a request
many times: tritonclient and Triton's tools stream to it); a sequence model's shows Triton's
`sequence_batching` block (sequence_config).
"""
from __future__ import annotations

import os
from typing import Iterable

from tgw.shm.wire import BYTES, model_key

from tgw.broker.models.entry import ModelEntry
from tgw.broker.pipeline.plan import Plan
from tgw.broker.state.stats import ModelCounters, Timed, VersionCounters

from .kserve import DATATYPE_OF

# the platform each tgw format is served as: Triton's own names for TorchScript, ONNX, Python
# (a stage) and ensembles; tgw's where Triton has none (export and AOTInductor archives)
PLATFORMS = {"torchscript": "pytorch_libtorch", "export": "pytorch_export", "aoti": "pytorch_aoti",
             "onnx": "onnxruntime_onnx", "stage": "python"}
BACKENDS = {"stage": "python", "onnx": "onnxruntime"}   # everything else runs on libtorch


def platform(fmt: str) -> str:
    """Triton's platform name of a tgw format (model_config's and the model metadata's)."""
    return PLATFORMS.get(fmt, f"pytorch_{fmt}")
ENSEMBLE = "ensemble"
INFERENCE_STATS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit",
                   "cache_miss")


def data_type(dtype: str) -> str:
    """tgw's dtype as Triton's config names it: float32 -> TYPE_FP32, bytes -> TYPE_STRING."""
    return "TYPE_STRING" if dtype == BYTES else "TYPE_" + DATATYPE_OF[dtype]


def numeric_aliases(versions: Iterable[str]) -> dict[str, str]:
    """Each version's numeric string (the module docstring's rule), by version name."""
    versions = list(versions)
    taken = {int(v) for v in versions if v.isdecimal()}
    out, nxt = {}, 1
    for v in versions:
        if v.isdecimal():
            out[v] = str(int(v))
            continue
        while nxt in taken:
            nxt += 1
        taken.add(nxt)
        out[v] = str(nxt)
    return out


def version_named(versions: Iterable[str], asked: str | None) -> str | None:
    """The version a path names: by its name, else by its numeric alias; unmatched: as asked
    (the caller's VERSION_NOT_FOUND names it)."""
    versions = list(versions)
    if asked is None or asked in versions:
        return asked
    for name, alias in numeric_aliases(versions).items():
        if alias == asked:
            return name
    return asked


def tensors(specs, output: bool = False) -> list[dict]:
    """Triton's input/output entries; dims without the batch dim (-1: variable); a declared
    tensor's (config TensorDecl) format, reshape and label file as Triton's config shows them."""
    out = []
    for t in specs:
        doc = {"name": t.name, "data_type": data_type(t.dtype), "dims": list(t.shape)}
        labels = getattr(t, "labels", None)
        doc.update({"label_filename": os.path.basename(labels) if labels else "", "is_shape_tensor": False} if output
                   else {"format": getattr(t, "format", None) or "FORMAT_NONE", "is_shape_tensor": False,
                         "allow_ragged_batch": False, "optional": False})
        reshape = getattr(t, "reshape", None)
        if reshape is not None:
            doc["reshape"] = {"shape": list(reshape)}
        out.append(doc)
    return out


def instance_groups(name: str, devices: Iterable[str]) -> list[dict]:
    """The workers holding the model, by kind: KIND_CPU, KIND_GPU (with their GPU indices)."""
    devices = list(devices)
    groups = []
    cpus = [d for d in devices if not d.startswith("cuda")]
    gpus = sorted(int(d.partition(":")[2] or 0) for d in devices if d.startswith("cuda"))
    if cpus:
        groups.append({"name": f"{name}_cpu", "kind": "KIND_CPU", "count": len(cpus), "gpus": []})
    if gpus:
        groups.append({"name": f"{name}_gpu", "kind": "KIND_GPU", "count": len(gpus), "gpus": sorted(set(gpus))})
    return groups


def holders(roster, model: str, versions: Iterable[str]) -> list[str]:
    """The device of each worker holding some of those versions of the model."""
    keys = {model_key(model, v) for v in versions}
    return [w.device for w in roster if keys & set(w.models)]


def model_config(entry: ModelEntry, version: str | None, devices: Iterable[str]) -> dict:
    """Triton's config of a model: `version` (None: the default one) picks the platform;
    `devices`: the workers holding it."""
    decl = entry.decl
    aliases = numeric_aliases(entry.records)
    shown = entry.records.get(version or entry.default or "")
    fmt = "stage" if decl.is_stage else (shown.format if shown is not None else "torchscript")
    doc = {"name": entry.name, "platform": platform(fmt), "backend": BACKENDS.get(fmt, "pytorch"),
           "version_policy": {"specific": {"versions": [int(aliases[v]) for v in entry.records]}},
           "max_batch_size": decl.max_batch_size, "input": tensors(decl.inputs), "output": tensors(decl.outputs, True),
           "instance_group": instance_groups(entry.name, devices),
           "parameters": {"tgw_default_version": {"string_value": entry.default or ""},
                          "tgw_versions": {"string_value": ",".join(f"{v}={a}" for v, a in aliases.items())}}}
    if decl.sequence_batching is not None:
        doc["parameters"].update({f"tgw_initial_state.{t.name}": {"string_value": repr(t.initial)}
                                  for t in decl.sequence_batching.state if t.initial != 0})
    if entry.is_generator:
        doc["model_transaction_policy"] = {"decoupled": True}
    if decl.sequence_batching is not None:
        doc["sequence_batching"] = sequence_config(decl)
    elif decl.max_batch_size > 1:
        doc["dynamic_batching"] = {"preferred_batch_size": list(decl.preferred_batch_sizes),
                                   "max_queue_delay_microseconds": decl.max_delay_us,
                                   "preserve_ordering": False}
    return doc


CONTROL_KINDS = {"start": "CONTROL_SEQUENCE_START", "end": "CONTROL_SEQUENCE_END",
                 "ready": "CONTROL_SEQUENCE_READY", "corrid": "CONTROL_SEQUENCE_CORRID"}


def control(kind: str, dtype: str) -> dict:
    """One Control entry: a flag's false/true values in its dtype's field (Triton has int32,
    fp32 and bool ones: other integer dtypes show as int32's, other floats as fp32's), the
    correlation id's data type."""
    doc = {"kind": CONTROL_KINDS[kind]}
    if kind == "corrid":
        doc["data_type"] = data_type(dtype)
    elif dtype == "bool":
        doc["bool_false_true"] = [False, True]
    elif dtype.startswith(("float", "bfloat")):
        doc["fp32_false_true"] = [0.0, 1.0]
    else:
        doc["int32_false_true"] = [0, 1]
    return doc


def sequence_config(decl) -> dict:
    """Triton's sequence_batching of a model declaring `sequence_batching:`. Strategy "oldest":
    tgw batches the waiting requests of different sequences together, as dynamic batching does
    (at most one per sequence), which is Triton's oldest strategy, not direct's batch slot bound
    to each sequence. A state's initial value shows as `zero_data` when it is 0 (Triton's
    InitialState has no fill value: another shows as the parameter tgw_initial_state.<name>)."""
    sb = decl.sequence_batching
    oldest = {"preferred_batch_size": list(decl.preferred_batch_sizes),
              "max_queue_delay_microseconds": decl.max_delay_us, "preserve_ordering": False}
    if sb.max_sequences is not None:
        oldest["max_candidate_sequences"] = sb.max_sequences
    states = []
    for t in sb.state:
        state = {"input_name": t.name, "output_name": t.output or t.name, "data_type": data_type(t.dtype),
                 "dims": list(t.shape)}
        if t.initial == 0:
            state["initial_state"] = [{"name": f"{t.name}_zero", "data_type": data_type(t.dtype),
                                       "dims": list(t.shape), "zero_data": True}]
        states.append(state)
    return {"oldest": oldest, "max_sequence_idle_microseconds": sb.max_sequence_idle_us,
            "control_input": [{"name": c.name, "control": [control(c.kind, c.dtype)]} for c in sb.control_inputs],
            "state": states}


def pipeline_config(plan: Plan, model_versions: dict[str, list[str]]) -> dict:
    """Triton's ensemble config of a pipeline. A step output that is a pipeline output is that
    ensemble tensor; any other is the tensor "<step>.<output>". `model_versions`: each step
    model's versions (for a pinned version's numeric alias; -1: the model's default)."""
    named = {text: out for out, text in plan.decl.outputs.items()}   # "step.output" -> pipeline output
    steps = []
    for step in plan.steps:
        outputs = {}
        for wanted in step.wanted:
            text = f"{step.name}.{wanted}"
            outputs[wanted] = named.get(text, text)
        version = -1
        if step.version is not None:
            version = int(numeric_aliases(model_versions.get(step.model, [step.version])).get(step.version, -1))
        steps.append({"model_name": step.model, "model_version": version,
                      "input_map": {inp: tensor_of(text, named) for inp, text in step.feeds},
                      "output_map": outputs})
    return {"name": plan.name, "platform": ENSEMBLE, "backend": "",
            "version_policy": {"specific": {"versions": [int(numeric_aliases([plan.version])[plan.version])]}},
            "max_batch_size": plan.max_batch_size, "input": tensors(plan.inputs), "output": tensors(plan.outputs, True),
            "ensemble_scheduling": {"step": steps}}


def tensor_of(text: str, named: dict[str, str]) -> str:
    """The ensemble tensor a step input reads: a pipeline input by its name, a step output as
    pipeline_config names it."""
    return named.get(text, text)


def timed(t: Timed | None) -> dict:
    return {"count": t.count, "ns": t.ns} if t is not None else {"count": 0, "ns": 0}


def memory_usage(roster, key: str) -> list[dict]:
    """Triton's MemoryUsage entries of one version: its measured footprint on each device that
    holds it (type GPU or CPU, id the device's index)."""
    out = []
    for w in roster:
        fp = w.footprints.get(key)
        if key in w.models and fp is not None and fp.measured_on:
            gpu = w.device.startswith("cuda")
            index = int(w.device.partition(":")[2] or 0) if gpu else 0
            out.append({"type": "GPU" if gpu else "CPU", "id": index, "byte_size": fp.total})
    return out


def version_stats(name: str, alias: str, v: VersionCounters | None, memory: list[dict] | None = None) -> dict:
    """One version's entry of Triton's model_stats. compute_infer is the batch's compute as the
    worker measured it, given to each of its requests; tgw does not time input and output
    copies apart from it (their counts follow compute_infer's, their ns is 0)."""
    v = v or VersionCounters()
    none, compute = Timed(), v.compute
    copies = {"count": compute.count, "ns": 0}
    return {"name": name, "version": alias, "last_inference": v.last_inference_ms,
            "inference_count": v.inferences, "execution_count": v.executions,
            "inference_stats": {"success": timed(v.success), "fail": timed(v.fail), "queue": timed(v.queue),
                                "compute_input": copies, "compute_infer": timed(compute),
                                "compute_output": dict(copies), "cache_hit": timed(none), "cache_miss": timed(none)},
            "response_stats": {},
            "batch_stats": [{"batch_size": rows, "compute_input": {"count": t.count, "ns": 0},
                             "compute_infer": timed(t), "compute_output": {"count": t.count, "ns": 0}}
                            for rows, t in sorted(v.batch_compute.items())],
            "memory_usage": memory or []}


def model_stats(entry: ModelEntry, counters: ModelCounters | None, version: str | None = None,
                roster=()) -> list[dict]:
    """Triton's model_stats entries of a model: each of its versions, or the one asked for; the
    memory each takes on the workers of `roster` that hold it."""
    aliases = numeric_aliases(entry.records)
    counted = counters.versions if counters is not None else {}
    return [version_stats(entry.name, alias, counted.get(v), memory_usage(roster, entry.records[v].key))
            for v, alias in aliases.items() if version is None or v == version]


def pipeline_stats(plan: Plan, counters) -> dict:
    """A pipeline's entry: its requests answered and failed (pipelines.py's counters; the
    steps' own work is in their models' entries)."""
    v = VersionCounters()
    if counters is not None:
        v.success.count = counters.replies
        v.fail.count = sum(counters.errors.values())
    return version_stats(plan.name, numeric_aliases([plan.version])[plan.version], v)


def statistics(entries: Iterable[dict]) -> dict:
    return {"model_stats": list(entries)}
