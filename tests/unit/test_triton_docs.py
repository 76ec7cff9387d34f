"""The Triton config and statistics builders (broker/protocol/triton_docs.py) on real entries and counters."""
from __future__ import annotations

from conftest import placeholder_model
from tgw.broker.config.load import ModelDecl
from tgw.broker.protocol import triton_docs as td
from tgw.broker.models.entry import ModelEntry
from tgw.broker.state.pending import Pending
from tgw.broker.state.stats import Stats


def entry(versions=("1",), **kw) -> ModelEntry:
    decl = ModelDecl(name="m", versions=[{"version": v, "path": placeholder_model()} for v in versions],
                     inputs=[{"name": "x", "dtype": "float32", "shape": [-1, 3]},
                             {"name": "t", "dtype": "bfloat16", "shape": []}],
                     outputs=[{"name": "y", "dtype": "int64", "shape": [2]}], **kw)
    return ModelEntry(decl)


def test_numeric_aliases_and_lookup():
    assert td.numeric_aliases(["1", "2"]) == {"1": "1", "2": "2"}
    assert td.numeric_aliases(["2", "beta", "gamma", "03"]) == {"2": "2", "beta": "1", "gamma": "4", "03": "3"}
    assert td.version_named(["2", "beta"], "1") == "beta"
    assert td.version_named(["2", "beta"], "beta") == "beta"
    assert td.version_named(["2", "beta"], "9") == "9"       # unmatched: as asked, for the caller's refusal
    assert td.data_type("bytes") == "TYPE_STRING" and td.data_type("bfloat16") == "TYPE_BF16"


def test_model_config_document():
    cfg = td.model_config(entry(max_batch_size=8, preferred_batch_sizes=[4, 8]), None, ["cpu", "cuda:1", "cuda:0"])
    assert cfg["platform"] == "pytorch_libtorch" and cfg["max_batch_size"] == 8
    assert [(t["name"], t["data_type"], t["dims"]) for t in cfg["input"]] == [("x", "TYPE_FP32", [-1, 3]),
                                                                               ("t", "TYPE_BF16", [])]
    assert cfg["output"][0]["data_type"] == "TYPE_INT64"
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [4, 8]
    assert [(g["kind"], g["count"], g["gpus"]) for g in cfg["instance_group"]] == [("KIND_CPU", 1, []),
                                                                                    ("KIND_GPU", 2, [0, 1])]
    assert "dynamic_batching" not in td.model_config(entry(max_batch_size=1), None, [])


def leaving(rows: int, arrived: float, dispatched: float | None = None, compute_us: int = 0) -> Pending:
    p = Pending(client=b"c", req_id=1, model="m", version="a", rows=rows, shape_key=(), tensors=[], outputs=[],
                deadline=9.0, arrived=arrived)
    p.dispatched, p.compute_us = dispatched, compute_us
    return p


def test_a_batch_leaving_counts_each_request():
    stats = Stats()
    stats.left("m", "a", [leaving(2, 1.0, 1.5, 100), leaving(1, 1.25, 1.5, 100), leaving(1, 1.5)], True, now=2.0)
    v = stats.models["m"].versions["a"]
    assert (v.success.count, v.success.ns) == (3, 1_000_000_000 + 750_000_000 + 500_000_000)
    assert (v.queue.count, v.queue.ns) == (3, 500_000_000 + 250_000_000)   # the undispatched one queued 0
    assert (v.compute.count, v.compute.ns, v.inferences) == (3, 200_000, 4)


def test_stats_document():
    stats, e = Stats(), entry(versions=("a", "b"))
    stats.left("m", "a", [leaving(3, arrived=1.0, dispatched=1.5, compute_us=200)], True, now=2.0)
    stats.left("m", "a", [leaving(1, arrived=1.0)], False, now=1.25)
    stats.batch("m", 3, 200, "a")
    a, b = td.model_stats(e, stats.models["m"])
    assert (a["version"], b["version"]) == ("1", "2")
    inf = a["inference_stats"]
    assert inf["success"] == {"count": 1, "ns": 1_000_000_000} and inf["fail"] == {"count": 1, "ns": 250_000_000}
    assert inf["queue"] == {"count": 1, "ns": 500_000_000} and inf["compute_infer"] == {"count": 1, "ns": 200_000}
    assert a["inference_count"] == 3 and a["execution_count"] == 1
    assert a["batch_stats"] == [{"batch_size": 3, "compute_input": {"count": 1, "ns": 0},
                                 "compute_infer": {"count": 1, "ns": 200_000}, "compute_output": {"count": 1, "ns": 0}}]
    assert b["inference_stats"]["success"]["count"] == 0 and b["batch_stats"] == []
    assert td.model_stats(e, stats.models["m"], "b") == [b]


def test_a_generator_shows_decoupled_and_a_sequence_model_its_sequence_batching():
    """Both documents parse as Triton's ModelConfig message (the gRPC face's ParseDict), so every
    field name is Triton's."""
    from google.protobuf.json_format import MessageToDict, ParseDict
    from tgw.broker.faces.grpc.proto import model_config_pb2 as mc
    from tgw.testing.generators import entry as generator_entry
    gen = td.model_config(ModelEntry(ModelDecl(**generator_entry("g"))), None, ["cpu"])
    assert gen["model_transaction_policy"] == {"decoupled": True}
    assert MessageToDict(ParseDict(gen, mc.ModelConfig()))["modelTransactionPolicy"] == {"decoupled": True}
    assert "model_transaction_policy" not in td.model_config(entry(max_batch_size=8), None, [])

    seq = entry(max_batch_size=8, preferred_batch_sizes=[4, 8], sequence_batching={
        "max_sequences": 16, "max_sequence_idle_us": 5_000_000,
        "state": [{"name": "acc_in", "output": "acc_out", "dtype": "float32", "shape": [4]},
                  {"name": "h_in", "output": "h_out", "dtype": "float16", "shape": [2, 3], "initial": 1.5}],
        "control_inputs": [{"name": "START", "kind": "start"}, {"name": "END", "kind": "end", "dtype": "bool"},
                           {"name": "READY", "kind": "ready", "dtype": "float32"},
                           {"name": "CORRID", "kind": "corrid", "dtype": "uint64"}]})
    cfg = td.model_config(seq, None, ["cpu"])
    sb = cfg["sequence_batching"]
    assert "dynamic_batching" not in cfg and "model_transaction_policy" not in cfg
    assert sb["max_sequence_idle_microseconds"] == 5_000_000
    assert sb["oldest"] == {"preferred_batch_size": [4, 8], "max_queue_delay_microseconds": seq.decl.max_delay_us,
                            "preserve_ordering": False, "max_candidate_sequences": 16}
    assert sb["control_input"] == [
        {"name": "START", "control": [{"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0, 1]}]},
        {"name": "END", "control": [{"kind": "CONTROL_SEQUENCE_END", "bool_false_true": [False, True]}]},
        {"name": "READY", "control": [{"kind": "CONTROL_SEQUENCE_READY", "fp32_false_true": [0.0, 1.0]}]},
        {"name": "CORRID", "control": [{"kind": "CONTROL_SEQUENCE_CORRID", "data_type": "TYPE_UINT64"}]}]
    acc, h = sb["state"]
    assert acc == {"input_name": "acc_in", "output_name": "acc_out", "data_type": "TYPE_FP32", "dims": [4],
                   "initial_state": [{"name": "acc_in_zero", "data_type": "TYPE_FP32", "dims": [4],
                                      "zero_data": True}]}
    assert "initial_state" not in h and h["data_type"] == "TYPE_FP16"
    assert cfg["parameters"]["tgw_initial_state.h_in"] == {"string_value": "1.5"}
    parsed = ParseDict(cfg, mc.ModelConfig())
    assert parsed.sequence_batching.WhichOneof("strategy_choice") == "oldest"
    assert parsed.sequence_batching.control_input[3].control[0].kind == \
        mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_CORRID
