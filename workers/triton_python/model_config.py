"""The model configuration a Triton Python model reads: the JSON document `initialize(args)`
gets as args["model_config"], as Triton writes it (field names as in config.pbtxt, 64-bit
numbers as numbers, the fields a model commonly reads present with their defaults), made from
the config tritonrepo translated (options.triton_model_config) or synthesised from the stage's
declared inputs and outputs; the lookups by name; and `ModelConfig`, what auto_complete_config
is handed.
"""
from __future__ import annotations

import copy
import json

from tgw.shm.wire import IOSpec, ModelSpec

from .tensors import BY_TGW_DTYPE, TYPES

# what Triton prints for every tensor and the top level (always_print_primitive_fields), the
# fields models read; the rest of the proto's defaults are left out
_IO_DEFAULTS = {"data_type": "TYPE_INVALID", "format": "FORMAT_NONE", "dims": [], "is_shape_tensor": False,
                "allow_ragged_batch": False, "optional": False, "is_non_linear_format_io": False}
_OUT_DEFAULTS = {"data_type": "TYPE_INVALID", "dims": [], "label_filename": "", "is_shape_tensor": False,
                 "is_non_linear_format_io": False}
_TOP_DEFAULTS = {"name": "", "platform": "", "backend": "python", "runtime": "", "max_batch_size": 0,
                 "input": [], "output": [], "batch_input": [], "batch_output": [], "instance_group": [],
                 "default_model_filename": "", "cc_model_filenames": {}, "metric_tags": {}, "parameters": {},
                 "model_warmup": []}


def _ints(values) -> list[int]:
    return [int(v) for v in values]


def normalised(config: dict) -> dict:
    """`config` (protobuf's MessageToDict form: int64 as strings, defaults absent) as Triton's
    JSON: int64 fields as numbers, the common fields with their defaults."""
    out = copy.deepcopy(config)
    for key, value in _TOP_DEFAULTS.items():
        out.setdefault(key, copy.deepcopy(value))
    out["max_batch_size"] = int(out["max_batch_size"])
    for key, defaults in (("input", _IO_DEFAULTS), ("output", _OUT_DEFAULTS)):
        for io in out[key]:
            for field, value in defaults.items():
                io.setdefault(field, copy.deepcopy(value))
            io["dims"] = _ints(io["dims"])
            if "reshape" in io:
                io["reshape"]["shape"] = _ints(io["reshape"].get("shape", []))
    specific = out.get("version_policy", {}).get("specific")
    if specific is not None:
        specific["versions"] = _ints(specific.get("versions", []))
    batching = out.get("dynamic_batching")
    if batching is not None:
        for field in ("max_queue_delay_microseconds", "priority_levels", "default_priority_level"):
            if field in batching:
                batching[field] = int(batching[field])
        batching["preferred_batch_size"] = _ints(batching.get("preferred_batch_size", []))
    for warmup in out["model_warmup"]:
        for value in warmup.get("inputs", {}).values():
            value["dims"] = _ints(value.get("dims", []))
    return out


def _io_doc(t: IOSpec) -> dict:
    doc = {"name": t.name, "data_type": TYPES[BY_TGW_DTYPE[t.dtype]][0], "dims": list(t.shape)}
    if t.reshape is not None:
        doc["reshape"] = {"shape": list(t.reshape)}
    return doc


def synthesised(spec: ModelSpec) -> dict:
    """The config Triton would show for a stage declared in tgw's YAML (no config.pbtxt)."""
    kind = "KIND_GPU" if spec.device == "cuda" else "KIND_CPU"
    return {"name": spec.name, "backend": "python",
            "max_batch_size": spec.max_batch_size if spec.batched else 0,
            "input": [_io_doc(t) for t in spec.inputs], "output": [_io_doc(t) for t in spec.outputs],
            "instance_group": [{"name": spec.name, "kind": kind, "count": 1}]}


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    """The config's input `name` (its dict), or None."""
    return next((io for io in model_config.get("input", []) if io["name"] == name), None)


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    """The config's output `name` (its dict), or None."""
    return next((io for io in model_config.get("output", []) if io["name"] == name), None)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


class ModelConfig:
    """What `auto_complete_config(auto_complete_model_config)` receives and returns. tgw serves
    the inputs and outputs declared in its config (or translated from config.pbtxt): changes made
    here are checked as Triton checks them, then ignored with a warning (adapter.py)."""

    def __init__(self, model_config):
        self._model_config = json.loads(model_config) if isinstance(model_config, str) else copy.deepcopy(model_config)

    def as_dict(self) -> dict:
        return self._model_config

    def _name(self) -> str:
        return self._model_config.get("name", "")

    def set_max_batch_size(self, max_batch_size: int) -> None:
        if self._model_config.get("max_batch_size", 0) > max_batch_size:
            raise ValueError(f"configuration specified max_batch_size {self._model_config['max_batch_size']}, but "
                             f"in auto-complete-config function for model '{self._name()}' specified "
                             f"max_batch_size {max_batch_size}")
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(f"Configuration specified scheduling_choice as '{other}', but auto-complete-config "
                                 f"function for model '{self._name()}' tries to set scheduling_choice as "
                                 "'dynamic_batching'")
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict) -> None:   # noqa: A002 - Triton's parameter name
        self._add("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: dict) -> None:
        self._add("output", output, ("name", "data_type", "dims"))

    def _add(self, key: str, tensor: dict, allowed: tuple[str, ...]) -> None:
        extra = [p for p in tensor if p not in allowed]
        if extra:
            raise ValueError(f"{key} '{tensor.get('name')}' in auto-complete-config function for model "
                             f"'{self._name()}' contains properties {extra}: only {list(allowed)} may be set")
        for needed in ("name", "data_type", "dims"):
            if needed not in tensor:
                raise ValueError(f"{key} in auto-complete-config function for model '{self._name()}' is missing "
                                 f"'{needed}' property.")
        present = self._model_config.setdefault(key, [])
        for current in present:
            if current["name"] != tensor["name"]:
                continue
            if current.get("data_type", "TYPE_INVALID") not in ("TYPE_INVALID", tensor["data_type"]):
                raise ValueError(f"unable to load model '{self._name()}', configuration expects datatype "
                                 f"{current['data_type']} for {key} '{tensor['name']}', model provides "
                                 f"{tensor['data_type']}")
            if current.get("dims") and _ints(current["dims"]) != _ints(tensor["dims"]):
                raise ValueError(f"model '{self._name()}', tensor '{tensor['name']}': the model expects dims "
                                 f"{list(tensor['dims'])} but the model configuration specifies dims "
                                 f"{list(current['dims'])}")
            current.update(tensor)
            return
        present.append(dict(tensor))

    def set_model_transaction_policy(self, transaction_policy_dict: dict) -> None:
        extra = [p for p in transaction_policy_dict if p != "decoupled"]
        if extra:
            raise ValueError(f"model transaction property in auto-complete-config function for model "
                             f"'{self._name()}' contains property other than 'decoupled'.")
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            if "decoupled" in policy and policy["decoupled"] != transaction_policy_dict["decoupled"]:
                raise ValueError(f"trying to change decoupled property in auto-complete-config for model "
                                 f"'{self._name()}', which is already set to '{policy['decoupled']}'.")
            policy["decoupled"] = transaction_policy_dict["decoupled"]
