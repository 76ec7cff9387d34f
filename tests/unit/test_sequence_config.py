"""A sequence model's `sequence_batching:` as its worker is told it (broker/models/entry.py
sequence_spec, ModelEntry.is_sequence), and the control inputs a model file cannot take refused
at config check with the reason."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from tgw.broker.config.load import ModelDecl
from tgw.broker.models.entry import ModelEntry, sequence_spec
from tgw.shm.wire import ControlSpec, ImplicitStateSpec

ACCUMULATOR = {"name": "acc", "versions": [{"version": "1", "path": "/m/acc.pt"}],
               "inputs": [{"name": "INPUT", "dtype": "int32", "shape": [1]}],
               "outputs": [{"name": "OUTPUT", "dtype": "int32", "shape": [1]}], "max_batch_size": 8}


def decl(**sb) -> ModelDecl:
    return ModelDecl.model_validate({**ACCUMULATOR, "sequence_batching": sb})


def test_the_worker_gets_the_state_controls_and_pool_size_as_declared():
    d = decl(state_memory_mb=0.5, control_inputs=[{"name": "START", "kind": "start"},
                                                  {"name": "CORRID", "kind": "corrid", "dtype": "uint64"}],
             state=[{"name": "S", "output": "S_OUT", "dtype": "float32", "shape": [2, 3], "initial": 1.5}])
    spec = sequence_spec(d.sequence_batching)
    assert spec.max_sequences == 0 and spec.state_memory == 1 << 19
    assert spec.state == [ImplicitStateSpec(name="S", dtype="float32", shape=[2, 3], output="S_OUT", initial=1.5)]
    assert spec.controls == [ControlSpec(kind="start", name="START", dtype="int32"),
                             ControlSpec(kind="corrid", name="CORRID", dtype="uint64")]
    entry = ModelEntry(d, versions=False)
    assert entry.is_sequence and not entry.is_generator
    assert not ModelEntry(ModelDecl.model_validate(ACCUMULATOR), versions=False).is_sequence


@pytest.mark.parametrize("sb, why", [
    ({"correlation_id": "string", "control_inputs": [{"name": "CORRID", "kind": "corrid", "dtype": "int64"}]},
     "'CORRID' \\(corrid\\) cannot carry string correlation ids: Triton feeds them as BYTES, which a TorchScript"),
    ({"control_inputs": [{"name": "CORRID", "kind": "corrid", "dtype": "int32"}]},
     "'CORRID' \\(corrid\\) carries uint64 ids: dtype int64 or uint64, not int32"),
    ({"control_inputs": [{"name": "START", "kind": "start", "dtype": "bytes"}]},
     "'START' \\(start\\) is 1/0: a numeric or bool dtype, not bytes"),
])
def test_a_control_a_model_file_cannot_take_is_refused_with_the_reason(sb, why):
    with pytest.raises(ValidationError, match=why):
        decl(max_sequences=4, **sb)
