"""End to end through real processes: results equal the in-process model, rows stay with callers."""
from __future__ import annotations

import multiprocessing as mp
import threading

import numpy as np
import pytest
import torch

from tgw.client import Client


@pytest.fixture(scope="module")
def local_models(model_files):
    return {name: torch.jit.load(path) for name, (path, _) in model_files.items() if name != "wrongdtype"}


def run_local(module, *arrays):
    with torch.inference_mode():
        out = module(*[torch.from_numpy(np.array(a)) for a in arrays])
    return out


def test_float32_matches_in_process(shared_broker, local_models):
    x = np.random.default_rng(0).standard_normal((5, 256), dtype=np.float32)
    with Client(shared_broker.address) as c:
        y = c.infer("mlp", {"x": x})["y"]
    assert y.shape == (5, 10) and y.dtype == np.float32
    np.testing.assert_allclose(y, run_local(local_models["mlp"], x).numpy(), rtol=1e-5, atol=1e-6)


def test_float16_bool_int64_and_tuple_outputs(shared_broker, local_models):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 4)).astype(np.float16)
    b = rng.random((3, 3)) > 0.5
    c_ = rng.integers(-1000, 1000, (3, 7), dtype=np.int64)
    with Client(shared_broker.address) as c:
        out = c.infer("mixed", {"c": c_, "a": a, "b": b})  # any order of names
    a2, nb, csum = run_local(local_models["mixed"], a, b, c_)
    assert out["a2"].dtype == np.float16 and out["nb"].dtype == np.bool_ and out["csum"].dtype == np.int64
    np.testing.assert_array_equal(out["a2"], a2.numpy())
    np.testing.assert_array_equal(out["nb"], nb.numpy())
    np.testing.assert_array_equal(out["csum"], csum.numpy())
    assert out["csum"].shape == (3,)


@pytest.mark.parametrize("length", [1, 5, 33])
def test_variable_dims(shared_broker, local_models, length):
    tokens = np.random.default_rng(length).integers(0, 5000, (2, length), dtype=np.int64)
    with Client(shared_broker.address) as c:
        out = c.infer("embed", {"tokens": tokens})
    ref = run_local(local_models["embed"], tokens)
    np.testing.assert_allclose(out["embedding"], ref["embedding"].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out["length"], [length, length])


def test_requested_output_subset_and_compression(shared_broker, local_models):
    tokens = np.arange(12, dtype=np.int64).reshape(3, 4)
    with Client(shared_broker.address) as c:
        out = c.infer("embed", {"tokens": tokens}, outputs=["length"], compress=True)
    assert list(out) == ["length"]
    np.testing.assert_array_equal(out["length"], [4, 4, 4])


def test_torch_tensors_accepted(shared_broker, local_models):
    x = torch.randn(2, 256)
    with Client(shared_broker.address) as c:
        y = c.infer("mlp", {"x": x})["y"]
    np.testing.assert_allclose(y, run_local(local_models["mlp"], x.numpy()).numpy(), rtol=1e-5, atol=1e-6)


def run_threads(target, client: Client, n: int) -> None:
    """target(client, seed) in n threads at once; returns when all are done."""
    threads = [threading.Thread(target=target, args=(client, seed)) for seed in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)


def _distinct_rows(seed: int, rows: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, 256), dtype=np.float32)
    x[:, 0] = seed  # a fingerprint of the caller
    return x


def test_threads_sharing_one_client_get_their_own_rows(shared_broker, local_models):
    mlp = local_models["mlp"]
    errors: list[str] = []

    def caller(c: Client, seed: int) -> None:
        for i in range(20):
            x = _distinct_rows(seed * 100 + i, 1 + (seed + i) % 4)
            y = c.infer("mlp", {"x": x})["y"]
            if not np.allclose(y, run_local(mlp, x).numpy(), rtol=1e-4, atol=1e-5):
                errors.append(f"thread {seed} request {i} got someone else's rows")

    with Client(shared_broker.address) as c:
        run_threads(caller, c, 8)
    assert not errors
    with Client(shared_broker.address) as c:
        sizes = c.stats()["models"]["mlp"]["batch_sizes"]
    assert sum(int(k) * v for k, v in sizes.items()) >= 8 * 20  # every row went through a batch


def _process_caller(address: str, seed: int, q) -> None:
    import torch as t  # the child checks against its own in-process run
    from tgw.client import Client as C
    bad = 0
    with C(address) as c:
        models = {m["name"]: m for m in c.models()}
        assert "mlp" in models
        for i in range(15):
            x = _distinct_rows(seed * 1000 + i, 3)
            y = c.infer("mlp", {"x": x})["y"]
            bad += int(y.shape != (3, 10))
            q.put((seed, i, x[:, 0].tolist(), y.tolist()))
    q.put(("done", seed, bad))


def test_processes_each_get_their_own_rows(shared_broker, local_models):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_process_caller, args=(shared_broker.address, s, q)) for s in range(3)]
    for p in procs:
        p.start()
    done, got = 0, []
    while done < 3:
        item = q.get(timeout=120)
        if item[0] == "done":
            done += 1
            assert item[2] == 0
        else:
            got.append(item)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert len(got) == 45
    mlp = local_models["mlp"]
    for seed, i, fingerprint, y in got:
        x = _distinct_rows(seed * 1000 + i, 3)
        assert fingerprint == x[:, 0].tolist()
        np.testing.assert_allclose(np.array(y, np.float32), run_local(mlp, x).numpy(), rtol=1e-4, atol=1e-5)


def test_models_and_health(shared_broker):
    with Client(shared_broker.address) as c:
        health = c.health()
        models = {m["name"]: m for m in c.models()}
    assert health["live"] and health["ready"]
    assert models["embed"]["inputs"] == [{"name": "tokens", "dtype": "int64", "shape": [-1]}]
    assert models["mlp"]["outputs"] == [{"name": "y", "dtype": "float32", "shape": [10]}]
    assert models["mlp"]["versions"] == ["1"] and models["mlp"]["max_batch_size"] == 64


def test_output_arena_smaller_than_the_load_recycles_blocks(model_files, make_broker):
    """Each output needs most of the 1 MiB output arena: every batch waits for released blocks."""
    from conftest import base_config
    b = make_broker(base_config(model_files, "double", workers={
        "devices": ["cpu"], "input_arena_mb": 4, "output_arena_mb": 1}, double={"max_batch_size": 1}))
    errors: list[str] = []

    def caller(c: Client, seed: int) -> None:
        for i in range(10):
            x = np.random.default_rng(seed * 100 + i).standard_normal((1, 150_000), dtype=np.float32)  # 600 KB
            y = c.infer("double", {"x": x}, timeout=30)["y"]
            if not np.array_equal(y, x * 2):
                errors.append(f"caller {seed} request {i}: wrong result")

    with Client(b.address) as c:
        run_threads(caller, c, 4)
        stats = c.stats()["models"]["double"]
    assert not errors
    assert stats["replies"] == 40 and stats["errors"] == {}
