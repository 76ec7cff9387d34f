"""Arena sizing (broker/config/arenas.py): `workers.input_arena_mb` / `output_arena_mb: auto` (the
default) sized from the model declarations at load; explicit sizes kept as given. (The sizes that
`tgw-broker check-config` prints: tests/process/test_check_config.py; a broker serving full
batches in the auto sizes: tests/process/test_auto_arenas.py.)"""
from __future__ import annotations

import random

import pytest

from conftest import placeholder_model
from tgw.broker.config.arenas import VARIABLE_OUTPUT_BYTES, input_need, output_need
from tgw.broker.config.load import ConfigError, WorkersDecl, parse_config
from tgw.shm.ring import RingAllocator, aligned_total

MIB = 1 << 20


def model(name: str, inputs: list, outputs: list, max_batch_size: int = 32) -> dict:
    return {"name": name, "versions": [{"version": "1", "path": placeholder_model()}], "max_batch_size": max_batch_size,
            "inputs": [{"name": f"i{k}", "dtype": d, "shape": s} for k, (d, s) in enumerate(inputs)],
            "outputs": [{"name": f"o{k}", "dtype": d, "shape": s} for k, (d, s) in enumerate(outputs)]}


def load(*models: dict, workers: dict | None = None, server: dict | None = None):
    return parse_config({"server": server or {}, "workers": workers or {"devices": ["cpu"]}, "models": list(models)},
                        base_dir="/")


RESNET = model("resnet", [("float32", [3, 64, 64])], [("float32", [1000])], 32)
MLP = model("mlp", [("float32", [256])], [("float32", [10])], 64)
EMBED = model("embed", [("int64", [-1])], [("float32", [32]), ("int64", [])], 32)


# ---- the rule -------------------------------------------------------------------------------------

def test_default_is_auto_and_fixed_dims_size_three_batches():
    cfg = load(RESNET)
    assert cfg.workers.input_arena_mb == "auto" and cfg.workers.output_arena_mb == "auto"
    # one batch: 32 rows x 3x64x64 float32 = 1.5 MiB; 2 in flight + ring slack = 3 batches -> 4.5 -> 5 MiB
    assert cfg.workers.input_bytes == 5 * MIB
    # 32 x 1000 float32 = 128,000 bytes (aligned up to 128,000), x 3 = 384,000 -> the 1 MiB minimum
    assert cfg.workers.output_bytes == 1 * MIB


def test_batches_in_flight_per_worker_scale_it():
    assert load(RESNET, server={"max_inflight_batches_per_worker": 4}).workers.input_bytes == 8 * MIB  # 5 x 1.5 = 7.5
    assert load(RESNET, server={"max_inflight_batches_per_worker": 1}).workers.input_bytes == 3 * MIB  # 2 x 1.5


def test_each_region_is_aligned_like_the_ring():
    # 7 rows: float16 [3] = 42 bytes -> 64, bool [5] = 35 -> 64, int32 [1000] = 28,000 -> 28,032
    m = parse_config({"models": [model("m", [("float16", [3]), ("bool", [5]), ("int32", [1000])],
                                       [("uint8", [1])], 7)]}, "/").models[0]
    assert input_need(m, 2, 64 * MIB) == 3 * (64 + 64 + 28032)
    assert output_need(m, 2) == 3 * 64


def test_several_models_take_the_largest():
    wide_out = model("wide", [("float32", [1])], [("float32", [65536])], 16)  # 4 MiB of outputs per batch
    cfg = load(MLP, RESNET, wide_out)
    assert cfg.workers.input_bytes == 5 * MIB      # resnet's inputs
    assert cfg.workers.output_bytes == 12 * MIB    # wide's outputs: 3 x 4 MiB


def test_variable_input_dims_hold_the_largest_admissible_request():
    limit = 3 * MIB + 1
    two = model("two", [("int64", [-1]), ("bool", [-1])], [("float32", [2])], 8)
    cfg = load(MLP, two, server={"max_request_bytes": limit})
    assert cfg.workers.input_bytes == 4 * MIB  # 3 MiB + 1, aligned, + one pad for the 2nd input -> whole MiB
    # every split of an admissible request over the two inputs fits the arena at once, so
    # admission never refuses a request within max_request_bytes for the arena's sake
    for first in (0, 1, 63, 65, limit // 2, limit - 1, limit):
        assert aligned_total([first, limit - first]) <= cfg.workers.input_bytes
    # the demo's embed under the default max_request_bytes (64 MiB)
    assert load(MLP, RESNET, EMBED).workers.input_bytes == 64 * MIB


def test_variable_output_dims_get_the_default_or_the_fixed_bound():
    grow = model("grow", [("float32", [2])], [("float32", [-1])], 32)
    assert load(grow).workers.output_bytes == VARIABLE_OUTPUT_BYTES
    # a -1 output next to a fixed one of 32 x 65536 float32 (8 MiB per batch): 3 x 8 MiB
    big = model("big", [("float32", [2])], [("float32", [-1]), ("float32", [65536])], 32)
    assert load(grow, big).workers.output_bytes == 24 * MIB
    assert load(EMBED).workers.output_bytes == 1 * MIB  # variable inputs, fixed outputs: the fixed rule


def test_explicit_sizes_are_kept():
    cfg = load(RESNET, EMBED, workers={"input_arena_mb": 3, "output_arena_mb": 40})
    assert (cfg.workers.input_bytes, cfg.workers.output_bytes) == (3 * MIB, 40 * MIB)
    mixed = load(RESNET, workers={"input_arena_mb": "auto", "output_arena_mb": 2})
    assert (mixed.workers.input_bytes, mixed.workers.output_bytes) == (5 * MIB, 2 * MIB)
    assert WorkersDecl(input_arena_mb=1, output_arena_mb=2).input_bytes == MIB  # no models needed


def test_unresolved_auto_is_an_error_not_a_guess():
    with pytest.raises(RuntimeError, match="workers.input_arena_mb is auto"):
        WorkersDecl().input_bytes  # noqa: B018


@pytest.mark.parametrize("bad", [0, 65537, "big", "Auto", True, 2.5])
def test_bad_sizes_are_one_readable_problem(bad):
    with pytest.raises(ConfigError) as info:
        load(MLP, workers={"input_arena_mb": bad})
    msg = str(info.value)
    assert "1 problem(s)" in msg and "workers.input_arena_mb: must be auto" in msg, msg


# ---- why (k + 1) batches: the ring's wrap-around --------------------------------------------------

def test_k_batches_do_not_always_fit_in_k_batches_of_ring():
    ring = RingAllocator(2 * 4096)
    small = ring.alloc(64)
    ring.alloc(4096)
    ring.release(small)           # one batch in flight, yet a second of full size finds no room:
    assert ring.alloc(4096) is None   # 64 bytes free before it, 4096 - 64 after it


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_k_plus_one_batches_of_ring_always_fit_k_in_flight(k):
    """Blocks of any size up to one batch, up to k live, freed oldest first (the worker runs
    batches in order): an allocation never finds the ring full."""
    block = 4096
    rng = random.Random(k)
    ring, live = RingAllocator((k + 1) * block), []
    for _ in range(20000):
        if len(live) == k or (live and rng.random() < 0.4):
            ring.release(live.pop(0))
        size = rng.choice([64, block, block - 64, rng.randrange(1, block + 1)])
        offset = ring.alloc(size)
        assert offset is not None, (ring.live(), size)
        live.append(offset)
