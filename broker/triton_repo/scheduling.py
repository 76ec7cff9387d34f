"""How a Triton model is scheduled, as tgw keys: dynamic_batching, sequence_batching,
instance_group, model_warmup, response_cache and the transaction policy."""
from __future__ import annotations

from tgw.broker.faces.grpc.proto import model_config_pb2 as mc

from .notes import Notes
from .tensors import DTYPE_OF, dims, dtype

MAX_PRIORITY_LEVELS = 16            # ModelDecl.priority_levels' bound
CACHE = {"entries": 1024, "max_bytes": 64 << 20}   # Triton sizes its cache per server (--cache-config)


def dynamic_batching(db, decl: dict, notes: Notes) -> None:
    field = "dynamic_batching"
    if db.max_queue_delay_microseconds:
        decl["max_delay_us"] = min(db.max_queue_delay_microseconds, 10_000_000)
        if db.max_queue_delay_microseconds > 10_000_000:
            notes.warn(f"{field}: max_queue_delay_microseconds", "capped at tgw's 10 s")
    if db.preferred_batch_size:
        decl["preferred_batch_sizes"] = sorted(set(db.preferred_batch_size))
    if db.preserve_ordering:
        notes.warn(f"{field}: preserve_ordering", "each request is answered on its own; order across requests is "
                   "not kept")
    if db.priority_levels:
        if db.priority_levels + 1 > MAX_PRIORITY_LEVELS:
            notes.refuse(f"{field}: priority_levels", f"{db.priority_levels}: tgw has at most "
                         f"{MAX_PRIORITY_LEVELS - 1} levels besides 0; a request with a higher priority would be "
                         "refused")
        # Triton's 1 (highest) .. N stay in order as tgw's levels; tgw's 0 is served first
        decl["priority_levels"] = min(db.priority_levels + 1, MAX_PRIORITY_LEVELS)
        if db.default_priority_level:
            notes.warn(f"{field}: default_priority_level", "a request without priority is served at tgw's level 0, "
                       "the first")
    if db.HasField("default_queue_policy"):
        queue_policy(db.default_queue_policy, f"{field}: default_queue_policy", decl, notes)
    if db.priority_queue_policy:
        notes.warn(f"{field}: priority_queue_policy", "tgw has one queue policy per model: the default one")


def queue_policy(qp, field: str, decl: dict, notes: Notes) -> None:
    if qp.max_queue_size:
        decl["max_queue"] = qp.max_queue_size
    if qp.default_timeout_microseconds:
        decl["timeout_ms"] = max(1, -(-qp.default_timeout_microseconds // 1000))
    if qp.timeout_action == mc.ModelQueuePolicy.DELAY:
        notes.warn(f"{field}: timeout_action", "DELAY: a timed-out request is answered with an error, as REJECT")
    if qp.allow_timeout_override:
        notes.warn(f"{field}: allow_timeout_override", "a request's own timeout always applies when shorter")


CONTROL_KIND = {"CONTROL_SEQUENCE_START": "start", "CONTROL_SEQUENCE_END": "end",
                "CONTROL_SEQUENCE_READY": "ready", "CONTROL_SEQUENCE_CORRID": "corrid"}


def sequence_batching(config, decl: dict, notes: Notes, is_stage: bool) -> None:
    sb, field = config.sequence_batching, "sequence_batching"
    if is_stage:
        notes.refuse(field, "a python-backend model with sequence batching is not served (tgw's sequence stages "
                     "read their flags from the batch, not from control tensors)")
        return
    if sb.iterative_sequence:
        notes.refuse(f"{field}: iterative_sequence", "not tgw's; a tgw generator steps its own sequences")
    strategy = sb.WhichOneof("strategy_choice")
    count = max(1, sum(g.count or 1 for g in config.instance_group)) if config.instance_group else 1
    slots = max(config.max_batch_size, 1) * count
    if strategy == "oldest" and sb.oldest.max_candidate_sequences:
        slots = sb.oldest.max_candidate_sequences
    if strategy:
        notes.warn(f"{field}: {strategy}", f"tgw's own batching of sequences; {slots} sequence slots per worker")
    out: dict = {"max_sequences": slots, "control_inputs": [], "state": []}
    if sb.max_sequence_idle_microseconds:
        out["max_sequence_idle_us"] = max(1000, sb.max_sequence_idle_microseconds)
    for ci in sb.control_input:
        for c in ci.control:
            kind = CONTROL_KIND[mc.ModelSequenceBatching.Control.Kind.Name(c.kind)]
            where = f"{field}: control_input {ci.name}"
            if kind == "corrid":
                t = dtype(c.data_type, f"{where}: data_type", notes)
                if t == "bytes":
                    out["correlation_id"] = "string"
                out["control_inputs"].append({"name": ci.name, "kind": kind, "dtype": t or "uint64"})
                continue
            pair, t = ((c.int32_false_true, "int32") if c.int32_false_true else
                       (c.fp32_false_true, "float32") if c.fp32_false_true else (c.bool_false_true, "bool"))
            if list(pair) not in ([0, 1], [False, True]):
                notes.refuse(f"{where}: false_true", f"{list(pair)}: tgw feeds 0 for false and 1 for true")
            out["control_inputs"].append({"name": ci.name, "kind": kind, "dtype": t})
    for s in sb.state:
        where = f"{field}: state {s.input_name}"
        state = {"name": s.input_name, "output": s.output_name, "dtype": dtype(s.data_type, f"{where}: data_type", notes),
                 "shape": dims(s.dims, f"{where}: dims", notes)}
        if any(d == -1 for d in s.dims):
            notes.refuse(f"{where}: dims", "a state's dims are fixed in tgw (-1 is not)")
        for init in s.initial_state:
            if init.WhichOneof("state_data") == "data_file":
                notes.refuse(f"{where}: initial_state", "data_file: tgw starts a state at one value (zero_data)")
        if s.use_same_buffer_for_input_output or s.use_growable_memory:
            notes.warn(f"{where}: use_same_buffer_for_input_output/use_growable_memory", "tgw keeps states in "
                       "slots of its own")
        out["state"].append(state)
    decl["sequence_batching"] = out


def instance_group(config, decl: dict, notes: Notes, is_stage: bool) -> None:
    groups = config.instance_group
    kinds = {mc.ModelInstanceGroup.Kind.Name(g.kind) for g in groups}
    if is_stage:   # a stage's device is its own key
        if "KIND_GPU" in kinds and "KIND_CPU" in kinds:
            notes.warn("instance_group: kind", "groups of both kinds: the stage runs on the CPU")
        if "KIND_GPU" in kinds and "KIND_CPU" not in kinds:
            decl["device"] = "cuda"
        elif "KIND_CPU" in kinds:
            decl["device"] = "cpu"
    elif "KIND_CPU" in kinds:
        notes.warn("instance_group: kind", "KIND_CPU: a model runs on every worker of workers.devices")
    if any(g.count > 1 for g in groups):
        notes.warn("instance_group: count", "one instance per worker of workers.devices; "
                   "workers.threads_per_worker sets its threads")
    if any(g.gpus for g in groups):
        notes.warn("instance_group: gpus", "tgw places models on the devices of workers.devices")
    extra = [f for f in ("rate_limiter", "secondary_devices", "profile", "passive", "host_policy")
             if any(g.HasField(f) if f == "rate_limiter" else getattr(g, f) for g in groups)]
    if extra:
        notes.warn(f"instance_group: {'/'.join(extra)}", "not tgw's")


def warmup(config, decl: dict, notes: Notes, is_stage: bool) -> None:
    """model_warmup: a model warms up on zeros of each listed batch size; a stage on "zeros" of
    numeric inputs with fixed dims."""
    sizes, other = [], set()
    for w in config.model_warmup:
        kinds = {i.WhichOneof("input_data_type") for i in w.inputs.values()}
        if kinds - {"zero_data"}:
            other |= kinds - {"zero_data"}
        if w.count > 1:
            other.add("count")
        sizes.append(max(1, w.batch_size))
    if other:
        notes.warn(f"model_warmup: {'/'.join(sorted(str(k) for k in other))}", "tgw warms up on zeros, once")
    if not sizes:
        return
    if is_stage:
        fixed = all(t["dtype"] not in (None, "bytes") and -1 not in t["shape"] for t in decl["inputs"])
        if fixed:
            decl["warmup_inputs"] = [{t["name"]: "zeros" for t in decl["inputs"]}]
        else:
            notes.warn("model_warmup", "a stage with bytes or variable-size inputs is warmed up by warmup_inputs "
                       "examples only")
        return
    decl["warmup_batch_sizes"] = sorted({min(s, max(config.max_batch_size, 1)) for s in sizes})


def transaction_and_cache(config, decl: dict, notes: Notes, is_stage: bool) -> None:
    if config.model_transaction_policy.decoupled:
        notes.refuse("model_transaction_policy: decoupled", "a decoupled model answers many times per request: "
                     "write it as a tgw generator (docs/GENERATION.md)")
    if config.response_cache.enable:
        if is_stage:
            notes.warn("response_cache", "a stage's answers are not cached (its code need not answer the same)")
        else:
            decl["cache"] = dict(CACHE)
            notes.warn("response_cache", f"cached with tgw's sizes: {CACHE['entries']} answers, "
                       f"{CACHE['max_bytes'] >> 20} MiB (Triton sizes its cache per server)")


__all__ = ["DTYPE_OF", "dynamic_batching", "instance_group", "sequence_batching", "transaction_and_cache", "warmup"]
