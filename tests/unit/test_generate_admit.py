"""A generation's checks at admission (broker/generate/admit.py), pure: the parameters a caller
may send, the cap, the drawn seed, the sequence ids."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from tgw.broker.generate.admit import GenerateCheck
from tgw.shm.errors import TgwError
from tgw.shm.wire import CudaIpc, GenerateParams, Infer, RegionSlice, Sampling, TensorMeta

pytestmark = pytest.mark.unit


def entry(generator: bool = True, cap: int = 16):
    decl = SimpleNamespace(generator=SimpleNamespace(max_outputs=cap) if generator else None)
    return SimpleNamespace(name="g", is_generator=generator, decl=decl)


def infer(params, **more) -> Infer:
    return Infer(v=2, id=1, model="g", inputs=[TensorMeta(name="prompt", dtype="int64", shape=[1, 3])],
                 generate=params, **more)


def refused(params, rows=1, e=None, **more) -> str:
    with pytest.raises(TgwError) as info:
        GenerateCheck().check(e or entry(), infer(params, **more), rows)
    assert info.value.code.value == "INVALID_ARGUMENT"
    return info.value.message


def test_what_passes_becomes_a_numbered_sequence_with_a_seed():
    check = GenerateCheck(random.Random(1))
    a = check.check(entry(), infer(GenerateParams()), 1)
    b = check.check(entry(), infer(GenerateParams(max_outputs=3, sampling=Sampling(temperature=0.5, seed=9))), 1)
    assert (a.seq, a.max_outputs, b.seq, b.max_outputs) == (1, 16, 2, 3)
    assert a.sampling.seed is not None and 0 <= a.sampling.seed < 1 << 63 and b.sampling.seed == 9
    assert check.check(entry(generator=False), infer(None), 4) is None   # a plain request of a plain model


@pytest.mark.parametrize("params, said", [
    (GenerateParams(max_outputs=17), "1..16"), (GenerateParams(max_outputs=0), "max_outputs 0"),
    (GenerateParams(sampling=Sampling(temperature=float("nan"))), "temperature"),
    (GenerateParams(sampling=Sampling(temperature=-0.1)), "temperature"),
    (GenerateParams(sampling=Sampling(top_p=1.5)), "top_p"), (GenerateParams(sampling=Sampling(top_p=0.0)), "top_p"),
    (GenerateParams(sampling=Sampling(top_k=-1)), "top_k"), (GenerateParams(sampling=Sampling(seed=-1)), "seed"),
    (GenerateParams(sampling=Sampling(stop_sequences=[[1], []])), "stop_sequences"),
])
def test_bad_parameters_are_named(params, said):
    assert said in refused(params)


def test_the_model_and_the_request_must_agree():
    assert "one row" in refused(GenerateParams(), rows=2)
    assert "'g' is a generator" in refused(None)
    assert "'g' is not a generator" in refused(GenerateParams(), e=entry(generator=False))


def test_a_generation_travels_in_frames():
    assert "no output_region" in refused(GenerateParams(), output_region=RegionSlice(region=1, offset=0, nbytes=8))
    cuda = CudaIpc(device=0, device_uuid="GPU-0", handle=b"h", storage_bytes=8, storage_offset_bytes=0)
    assert "CUDA" in refused(GenerateParams(), output_cuda={"token": cuda})
