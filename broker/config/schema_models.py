"""The models' part of the configuration's schema: tensors, versions, breakers, models (and
stages: models whose versions name a handler class instead of a file).

schema.py re-exports these with the rest of the schema.
"""
from __future__ import annotations

import importlib
import math
import sys
from typing import Annotated, Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from tgw.shm.wire import BYTES, DTYPES, WIRE_DTYPES

from .strict import Strict


class TensorDecl(Strict):
    name: Annotated[str, Field(min_length=1)]
    dtype: str
    shape: list[int] = Field(description="dims without the batch dimension; -1 = variable")
    # Triton's input `format` (shown in the config document; the data is not transposed)
    format: Optional[Literal["FORMAT_NONE", "FORMAT_NCHW", "FORMAT_NHWC"]] = None
    # the shape the model itself takes/returns (without the batch dim) when it differs from `shape`
    reshape: Optional[list[int]] = None
    # an output's label file (one label per line, line k = class k) for the classification extension
    labels: Optional[str] = None

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in DTYPES:
            raise ValueError(f"unknown dtype {v!r}; one of {', '.join(DTYPES)}")
        return v

    @field_validator("shape")
    @classmethod
    def _dims(cls, v: list[int]) -> list[int]:
        if any(d == 0 or d < -1 for d in v):
            raise ValueError(f"dims must be positive or -1 (variable), got {v}")
        return v


class VersionDecl(Strict):
    version: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")]
    path: Optional[str] = None     # a model file (exactly one of path and handler)
    # a stage's class: "file.py:Class" (a file under model_roots) or "package.module:Class"
    handler: Optional[Annotated[str, Field(pattern=r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$")]] = None
    sha256: Optional[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] = None
    # what the file holds (shm/model_format.py tells it from the file); parse_config fills it in;
    # "stage" for a handler
    format: Optional[Literal["torchscript", "export", "aoti", "onnx", "stage"]] = None
    weight: Optional[Annotated[int, Field(ge=0, le=1_000_000)]] = None  # share of requests naming no version

    @model_validator(mode="after")
    def _one_source(self) -> "VersionDecl":
        if (self.path is None) == (self.handler is None):
            raise ValueError("a version names exactly one of path (a model file) and handler (a stage's class)")
        if self.handler is not None and self.format not in (None, "stage"):
            raise ValueError(f"format {self.format!r} is a model file's; a handler is a stage")
        if self.path is not None and self.format == "stage":
            raise ValueError("format stage needs handler: FILE.py:Class or module:Class, not path")
        return self


class BreakerDecl(Strict):
    """The circuit breaker of each version of a model (broker/sched/breaker.py): it opens on any trip,
    sends requests to `fallback` (or answers CIRCUIT_OPEN) for cooldown_s, then lets `probes`
    requests through half-open and closes when they all succeed."""
    error_rate: Annotated[float, Field(gt=0, le=1)] = 0.5      # failed share of the window's requests ...
    window_s: Annotated[float, Field(gt=0, le=3600)] = 10.0   # ... over this sliding window ...
    min_requests: Annotated[int, Field(ge=1)] = 20             # ... once it holds this many
    p99_factor: Optional[Annotated[float, Field(ge=1)]] = 3.0  # compute p99 over factor x slo_p99_ms (needs it)
    memory_fraction: Optional[Annotated[float, Field(gt=0, le=1)]] = None  # a serving worker's memory share
    cooldown_s: Annotated[float, Field(gt=0, le=3600)] = 5.0
    probes: Annotated[int, Field(ge=1, le=1000)] = 3
    fallback: Optional[Annotated[str, Field(min_length=1)]] = None  # a model with the same inputs and outputs


class CacheDecl(Strict):
    """A model's response cache (broker/cache/responses.py, docs/CACHE.md): answers to inputs seen
    before, per version, given by the broker without a worker; least recently used go first."""
    entries: Annotated[int, Field(ge=1)]          # answers kept at most ...
    max_bytes: Annotated[int, Field(ge=1)]        # ... and their outputs' bytes (plus 16 per key) at most
    ttl_s: Optional[Annotated[float, Field(gt=0)]] = None   # an answer older than this is not given; None: no limit


class StateDecl(Strict):
    """One per-sequence state tensor of a generator: its worker allocates [slots, *shape] of it
    once, at load, on the model's device (docs/GENERATION.md "State slots")."""
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
    dtype: str
    shape: list[Annotated[int, Field(ge=1)]] = Field(description="per sequence, every dim fixed")

    @field_validator("dtype")
    @classmethod
    def _numeric(cls, v: str) -> str:
        if v not in DTYPES or v == BYTES:
            raise ValueError(f"state dtype {v!r}: one of {', '.join(d for d in DTYPES if d != BYTES)}")
        return v


class GeneratorDecl(Strict):
    """A model whose requests answer many times (docs/GENERATION.md): its handler's prefill and
    step run in a loop its worker owns, each sequence's state in a slot of a pool allocated at load."""
    state: Annotated[list[StateDecl], Field(min_length=1)]
    max_sequences: Optional[Annotated[int, Field(ge=1, le=65536)]] = None   # slots per worker ...
    state_memory_mb: Optional[Annotated[float, Field(gt=0)]] = None          # ... or as many as this holds
    max_length: Optional[Annotated[int, Field(ge=2)]] = None   # positions (prompt + outputs) a sequence may reach
    length_input: Optional[str] = None   # the input whose element count is the prompt's length (default: the first)
    max_outputs: Annotated[int, Field(ge=1, le=1_000_000)] = 256    # the default and the cap per request
    max_prefill_rows: Annotated[int, Field(ge=1, le=4096)] = 8      # new sequences prefilled per step at most
    end_tokens: list[int] = []           # the model's own stop tokens (a sampled generator's)
    # outputs a slow caller may leave unread before its sequence is ended (OVERLOADED) and its slot freed
    max_unread_outputs: Annotated[int, Field(ge=1)] = 1024
    # text <-> token ids in the broker (docs/OPENAI.md): "bytes" (tgw.shm.byte_tokenizer) or
    # "package.module:Class"; a generator that declares one is an OpenAI-compatible model
    tokenizer: Optional[str] = None

    @field_validator("tokenizer")
    @classmethod
    def _importable(cls, v: str | None) -> str | None:
        if v is not None:
            tokenizer_class(v)   # imported now: a config that names a missing class does not load
        return v

    @model_validator(mode="after")
    def _sized(self) -> "GeneratorDecl":
        if (self.max_sequences is None) == (self.state_memory_mb is None):
            raise ValueError("a generator sizes its slot pool by exactly one of max_sequences and state_memory_mb")
        names = [t.name for t in self.state]
        if len(set(names)) != len(names):
            raise ValueError(f"state names repeat: {names}")
        return self


def tokenizer_class(spec: str) -> type:
    """The class `generator.tokenizer` names: "bytes" (the byte tokenizer) or "package.module:Class"
    with encode(str) -> list[int] and decode(list[int]) -> str, importable without torch (the
    broker never imports it). ValueError naming the key when it is not."""
    if spec == "bytes":
        from tgw.shm.byte_tokenizer import Tokenizer
        return Tokenizer
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"generator.tokenizer {spec!r}: \"bytes\" or \"package.module:Class\"")
    had_torch = "torch" in sys.modules
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"generator.tokenizer {spec!r} cannot be imported: {type(exc).__name__}: {exc}") from None
    if not had_torch and "torch" in sys.modules:
        raise ValueError(f"generator.tokenizer {spec!r} imports torch: the broker runs the tokenizer and never "
                         "imports torch")
    if not (isinstance(cls, type) and callable(getattr(cls, "encode", None)) and callable(getattr(cls, "decode", None))):
        raise ValueError(f"generator.tokenizer {spec!r} is not a class with encode(str) and decode(list[int])")
    return cls


class ControlInputDecl(Strict):
    """A control input the worker feeds a sequence model written for Triton's PyTorch backend
    (Triton's control_input): [batch, 1] of `dtype`, 1/0 for start, end and ready, the
    correlation id for corrid."""
    name: Annotated[str, Field(min_length=1)]
    kind: Literal["start", "end", "ready", "corrid"]
    dtype: str = "int32"

    _known = field_validator("dtype")(TensorDecl._known_dtype.__func__)


class SequenceStateDecl(Strict):
    """A per-sequence state tensor of a sequence model (Triton's implicit state): its worker
    allocates [slots, *shape] once, at load. For a model file, `name` is the input the state is
    fed as and `output` the output the model returns its next value in (Triton's input_name and
    output_name); a handler class reads and writes batch.state[name] itself (no `output`)."""
    name: Annotated[str, Field(min_length=1)]
    output: Optional[str] = None
    dtype: str
    shape: list[Annotated[int, Field(ge=1)]] = Field(description="per sequence, every dim fixed")
    initial: float = 0.0   # every element of a slot at its sequence's start

    _numeric = field_validator("dtype")(StateDecl._numeric.__func__)


class SequenceBatchingDecl(Strict):
    """A sequence model (docs/SEQUENCES.md): the caller steps each sequence with requests carrying
    its correlation id and start/end flags; the state lives in worker-owned slots between them."""
    state: list[SequenceStateDecl] = []
    control_inputs: list[ControlInputDecl] = []
    max_sequences: Optional[Annotated[int, Field(ge=1, le=65536)]] = None   # slots per worker ...
    state_memory_mb: Optional[Annotated[float, Field(gt=0)]] = None          # ... or as many as this holds
    # Triton's max_sequence_idle_microseconds: a sequence with no request for this long ends, its slot freed
    max_sequence_idle_us: Annotated[int, Field(ge=1000)] = 1_000_000
    correlation_id: Literal["uint64", "string"] = "uint64"   # the kind of id its requests carry

    @model_validator(mode="after")
    def _sized(self) -> "SequenceBatchingDecl":
        if (self.max_sequences is None) == (self.state_memory_mb is None):
            raise ValueError("a sequence model sizes its slot pool by exactly one of max_sequences and state_memory_mb")
        names = [t.name for t in self.state] + [c.name for c in self.control_inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"state and control input names repeat: {names}")
        kinds = [c.kind for c in self.control_inputs]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"control_inputs: each kind at most once, got {kinds}")
        self._controls_feedable()
        return self

    def _controls_feedable(self) -> None:
        """Each control input a tensor a model file can take (TorchScript takes no strings)."""
        for c in self.control_inputs:
            if c.kind == "corrid" and self.correlation_id == "string":
                raise ValueError(f"control_inputs: {c.name!r} (corrid) cannot carry string correlation ids: Triton "
                                 "feeds them as BYTES, which a TorchScript or torch.export model cannot take; use "
                                 "correlation_id: uint64, or drop the corrid control")
            if c.kind == "corrid" and c.dtype not in ("int64", "uint64"):
                raise ValueError(f"control_inputs: {c.name!r} (corrid) carries uint64 ids: dtype int64 or uint64, "
                                 f"not {c.dtype}")
            if c.dtype == "bytes":
                raise ValueError(f"control_inputs: {c.name!r} ({c.kind}) is 1/0: a numeric or bool dtype, not bytes")


class ModelDecl(Strict):
    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]
    versions: Annotated[list[VersionDecl], Field(min_length=1)]
    default_version: Optional[str] = None
    inputs: Annotated[list[TensorDecl], Field(min_length=1)]
    outputs: Annotated[list[TensorDecl], Field(min_length=1)]
    # 0: no batch dimension (Triton's max_batch_size 0): each request runs alone, shapes as declared
    max_batch_size: Annotated[int, Field(ge=0, le=4096)] = 32
    max_queue: Annotated[int, Field(ge=1)] = 1024
    timeout_ms: Annotated[int, Field(ge=1)] = 30000
    warmup_batch_sizes: list[Annotated[int, Field(ge=1)]] = [1]
    # scheduling (broker/sched/batcher.py, concurrency.py, breaker.py; docs/ARCHITECTURE.md "Scheduling")
    preferred_batch_sizes: list[Annotated[int, Field(ge=1)]] = []
    max_delay_us: Annotated[int, Field(ge=0, le=10_000_000)] = 0   # 0: work-conserving, never wait on purpose
    priority_levels: Annotated[int, Field(ge=1, le=16)] = 3
    aging_batches: Annotated[float, Field(gt=0)] = 8.0   # waited this many recent batch times: up one level
    slo_p99_ms: Optional[Annotated[float, Field(gt=0)]] = None
    adaptive_concurrency: bool = True                    # AIMD limit against slo_p99_ms (needs it)
    breaker: Optional[BreakerDecl] = None
    residency: Literal["always", "on_demand"] = "always"  # on_demand: loaded on first use, LRU-evictable
    # reduced precisions its float32 inputs may travel in (client wire_dtype=); widened to float32 on arrival
    wire_dtypes: list[str] = []
    # stages only (versions with a handler): where it runs, and what its setup(context) is given
    device: Optional[Literal["cpu", "cuda"]] = None   # None: cpu
    options: dict[str, Any] = {}
    # stages only: examples the worker calls the stage with once at load, each {input: one row's
    # value} (docs/STAGES.md "Warm-up inputs"); a version that raises on them is not served
    warmup_inputs: list[dict[str, Any]] = []
    cache: Optional[CacheDecl] = None   # models only: a response cache; None: off
    # a stage that generates (docs/GENERATION.md): requests answer many times; None: once
    generator: Optional[GeneratorDecl] = None
    # a sequence model (docs/SEQUENCES.md): client-driven steps with state kept per sequence; None: stateless
    sequence_batching: Optional[SequenceBatchingDecl] = None

    @property
    def is_stage(self) -> bool:
        return self.versions[0].handler is not None

    @property
    def batched(self) -> bool:
        """False for max_batch_size 0: requests carry no batch dim and each runs alone."""
        return self.max_batch_size > 0

    @property
    def max_rows(self) -> int:
        """The most rows in one batch: an unbatched model's request is one row inside tgw."""
        return max(self.max_batch_size, 1)

    @field_validator("wire_dtypes")
    @classmethod
    def _wire_dtypes(cls, v: list[str]) -> list[str]:
        unknown = [d for d in v if d not in WIRE_DTYPES]
        if unknown:
            raise ValueError(f"unknown wire_dtypes {unknown}; one of {', '.join(WIRE_DTYPES)}")
        return list(dict.fromkeys(v))

    @model_validator(mode="after")
    def _consistent(self) -> "ModelDecl":
        if self.default_version is not None and self.default_version not in {v.version for v in self.versions}:
            raise ValueError(f"default_version {self.default_version!r} is not one of the declared versions")
        if self.weighted and self.default_version is not None:
            raise ValueError("default_version and per-version weight are exclusive: requests that name no version "
                             "follow the weights")
        if self.weighted and not any(v.weight for v in self.versions):
            raise ValueError(f"weights of model {self.name!r} sum to 0: at least one version needs a weight > 0")
        for key in ("warmup_batch_sizes", "preferred_batch_sizes"):
            too_big = [b for b in getattr(self, key) if b > max(self.max_batch_size, 1)]
            if too_big:
                raise ValueError(f"{key} {too_big} exceed max_batch_size {self.max_batch_size}")
        if not self.batched and (self.generator is not None or self.sequence_batching is not None):
            raise ValueError(f"model {self.name!r}: max_batch_size 0 (no batch dim) is not offered for generators and "
                             "sequence models (their state is kept per batch row)")
        misplaced = [f"input {t.name!r} has labels (an output's label file)" for t in self.inputs if t.labels] + \
            [f"output {t.name!r} has a format (an input's, Triton's)" for t in self.outputs if t.format]
        if misplaced:
            raise ValueError(f"model {self.name!r}: " + "; ".join(misplaced))
        for t in (*self.inputs, *self.outputs):
            problem = reshape_problem(t)
            if problem:
                raise ValueError(f"model {self.name!r}: {problem}")
        if self.wire_dtypes and not any(t.dtype == "float32" for t in self.inputs):
            raise ValueError(f"wire_dtypes {self.wire_dtypes}: model {self.name!r} has no float32 input (only "
                             "float32 inputs travel at a reduced precision)")
        if len({v.handler is None for v in self.versions}) > 1:
            raise ValueError(f"model {self.name!r} mixes handler (stage) and path (model file) versions")
        if not self.is_stage:
            if self.device is not None or self.options or self.warmup_inputs:
                raise ValueError(f"device, options and warmup_inputs are a stage's keys; model {self.name!r} has "
                                 "no handler (a model warms up on zeros of warmup_batch_sizes)")
            carried = [t.name for t in (*self.inputs, *self.outputs) if t.dtype == BYTES]
            if carried:
                raise ValueError(f"tensors {carried} are bytes: only stages (versions with a handler) take or "
                                 "return bytes tensors; a model's tensors are numeric")
        else:
            for k, example in enumerate(self.warmup_inputs):
                problem = example_problem(self.inputs, example)
                if problem:
                    raise ValueError(f"warmup_inputs[{k}]: {problem}")
        if self.is_stage and self.cache is not None:
            raise ValueError(f"cache is a model's key: stage {self.name!r} runs handler code that need not give the "
                             "same outputs for the same inputs (docs/CACHE.md)")
        if self.generator is not None:
            self._generator_fits()
        if self.sequence_batching is not None:
            self._sequence_fits()
        if self.breaker and self.breaker.fallback == self.name:
            raise ValueError(f"breaker.fallback of model {self.name!r} names the model itself")
        return self

    def _generator_fits(self) -> None:
        g = self.generator
        if not self.is_stage:
            raise ValueError(f"generator: model {self.name!r} needs versions with a handler (a class with "
                             "setup, prefill and step), not a model file")
        if self.cache is not None:
            raise ValueError(f"cache: generator {self.name!r} answers many times; a response cache keeps one answer")
        names = [t.name for t in self.inputs]
        if g.length_input is not None and g.length_input not in names:
            raise ValueError(f"generator.length_input {g.length_input!r} is not one of the inputs {names}")
        if any(t.dtype == BYTES or -1 in t.shape for t in self.outputs):
            raise ValueError(f"generator {self.name!r}: each output is one fixed-shape numeric value per step "
                             "(no bytes, no -1 dims)")
        if g.tokenizer is not None:   # the OpenAI face feeds token ids in and reads token ids out
            if len(self.inputs) != 1 or not self.inputs[0].dtype.startswith(("int", "uint")) \
                    or self.inputs[0].shape != [-1]:
                raise ValueError(f"generator.tokenizer: model {self.name!r} needs exactly one input, integer token "
                                 "ids of shape [-1], to be fed a tokenized prompt")
            if len(self.outputs) != 1 or not self.outputs[0].dtype.startswith(("int", "uint")) \
                    or self.outputs[0].shape not in ([], [1]):
                raise ValueError(f"generator.tokenizer: model {self.name!r} needs exactly one output, an integer "
                                 "token id per step (shape [] or [1]), to be decoded")
            template = self.options.get("chat_template")
            if template is not None:   # its syntax checked with the config (check-config), run by the face
                from jinja2 import Environment, TemplateSyntaxError
                try:
                    Environment().parse(template if isinstance(template, str) else "{{")
                except TemplateSyntaxError as exc:
                    raise ValueError(f"options.chat_template of model {self.name!r}: "
                                     f"{'not a string' if not isinstance(template, str) else exc}") from None

    def _sequence_fits(self) -> None:
        sb = self.sequence_batching
        if self.generator is not None:
            raise ValueError(f"model {self.name!r}: generator and sequence_batching exclude each other (a generator "
                             "steps its sequences itself; a sequence model is stepped by its callers)")
        if self.cache is not None:
            raise ValueError(f"cache: sequence model {self.name!r} answers from its state; a response cache cannot")
        declared = {t.name for t in (*self.inputs, *self.outputs)}
        clash = [n for n in [t.name for t in sb.state] + [c.name for c in sb.control_inputs] if n in declared]
        if clash:
            raise ValueError(f"sequence_batching: {clash} are fed by the worker, not sent by callers: leave them out "
                             "of inputs/outputs")
        if self.is_stage:
            if sb.control_inputs or any(t.output for t in sb.state):
                raise ValueError(f"sequence_batching: model {self.name!r} is a handler class: it reads the flags and "
                                 "state from its batch (no control_inputs, no state output names)")
        else:
            missing = [t.name for t in sb.state if not t.output]
            if missing:
                raise ValueError(f"sequence_batching.state {missing}: a model file returns each state's next value "
                                 "in an output: name it (output:)")

    def signature(self) -> tuple:
        """What a fallback must share with this model: every input and output, as declared."""
        return tuple((t.name, t.dtype, tuple(t.shape)) for t in self.inputs), \
            tuple((t.name, t.dtype, tuple(t.shape)) for t in self.outputs)

    @property
    def weighted(self) -> bool:
        return any(v.weight is not None for v in self.versions)

    def weights(self) -> dict[str, int]:
        """version -> its share of the requests that name no version (a missing weight is 0)."""
        if self.weighted:
            return {v.version: v.weight or 0 for v in self.versions}
        return {self.default: 100}   # all of it, shown as 100 %

    @property
    def default(self) -> str:
        """Weighted: the heaviest version (ties: the later declared); else default_version or the last."""
        if self.weighted:
            return max(reversed(self.versions), key=lambda v: v.weight or 0).version
        return self.default_version or self.versions[-1].version


def example_problem(inputs: list[TensorDecl], example: dict) -> str | None:
    """What is wrong with one `warmup_inputs` example (one row: each declared input's value
    without the batch dim), or None. A fixed dtype takes nested lists of numbers of the declared
    shape (-1: any size) or "zeros"; a bytes input takes, per element, a string (its UTF-8
    bytes), {base64: TEXT} or {file: PATH} (relative to the handler's folder)."""
    names = [t.name for t in inputs]
    if sorted(example) != sorted(names):
        return f"names inputs {sorted(example)}; the stage's inputs are {names} (each one row's value)"
    for t in inputs:
        value = example[t.name]
        if t.dtype != BYTES and value == "zeros":
            continue
        problem = _value_problem(t, value, t.shape, [])
        if problem:
            return f"input {t.name!r}: {problem}"
    return None


def _value_problem(t: TensorDecl, value: Any, dims: list[int], at: list[int]) -> str | None:
    where = "".join(f"[{i}]" for i in at)
    if dims:
        if not isinstance(value, list) or (dims[0] != -1 and len(value) != dims[0]):
            got = f"{len(value)} items" if isinstance(value, list) else type(value).__name__
            return f"{where or 'the value'} is {got}; declared shape {t.shape} (-1: any size) needs a list of " \
                   f"{'any number of' if dims[0] == -1 else dims[0]} items here"
        for i, item in enumerate(value):
            problem = _value_problem(t, item, dims[1:], [*at, i])
            if problem:
                return problem
        return None
    if t.dtype == BYTES:
        ok = isinstance(value, str) or (isinstance(value, dict) and len(value) == 1 and (
            isinstance(value.get("base64"), str) or _relative(value.get("file"))))
        return None if ok else f"element {where or ''} is {value!r}: a bytes element is a string, {{base64: TEXT}} " \
                                "or {file: PATH} (a path relative to the handler's folder, without '..')"
    number = (bool, int, float) if t.dtype == "bool" else (int, float) if "float" in t.dtype else (int,)
    if isinstance(value, bool) and t.dtype != "bool" or not isinstance(value, number):
        return f"element {where} is {value!r}, not a {t.dtype} value"
    return None


def _relative(path: Any) -> bool:
    return isinstance(path, str) and bool(path) and not path.startswith("/") and ".." not in path.split("/")


def reshape_problem(t: TensorDecl) -> str | None:
    """Why a tensor's `reshape` cannot stand for its `shape` (None: it can, or there is none): the
    same element count, and its -1 dims taken, in order, from the shape's -1 dims (Triton's rule)."""
    if t.reshape is None:
        return None
    fixed = lambda dims: math.prod(d for d in dims if d != -1)   # noqa: E731
    if any(d < -1 or d == 0 for d in t.reshape) or t.reshape.count(-1) != t.shape.count(-1) \
            or fixed(t.reshape) != fixed(t.shape):
        return (f"tensor {t.name!r}: reshape {t.reshape} does not hold the elements of shape {t.shape} (the same count "
                "of fixed elements, and as many -1 dims)")
    return None
