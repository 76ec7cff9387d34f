"""The response cache (broker/cache/responses.py) as a pure class, times passed in: LRU under its
entry and byte bounds, ttl_s, the key, versions dropped; then its place in admission and the
registry (a hit is never queued, swaps and removals drop answers at once) and in the config."""
from __future__ import annotations

import pytest

from conftest import unloaded_model
from fake_clock import Clock
from rigs import tenants_of
from tgw.broker.cache.responses import KEY_BYTES, Held, ResponseCache
from tgw.broker.config.load import ConfigError, parse_config
from tgw.broker.config.schema import CacheDecl
from tgw.broker.models.registry import FULL_WEIGHT, Registry
from tgw.broker.sched.admission import Admission, Owed
from tgw.broker.sched.batcher import Batcher
from tgw.broker.state.pending import Pending
from tgw.broker.state.stats import Stats
from tgw.shm.wire import PROTOCOL_VERSION, CudaIpc, Infer, TensorMeta

OUT = 16   # bytes of each answer's one output ([1, 4] float32)


def request(data: bytes = bytes(16), version: str = "1", dtype: str = "float32", shape=(1, 4), outputs=("y",),
            model: str = "m", cuda=None) -> tuple[Pending, Infer]:
    msg = Infer(v=PROTOCOL_VERSION, id=1, model=model, inputs=[TensorMeta(name="x", dtype=dtype, shape=list(shape),
                                                                         cuda=cuda)])
    p = Pending(client=b"c", req_id=1, model=model, version=version, rows=shape[0], shape_key=(), tensors=[data],
                outputs=list(outputs), deadline=1e9)
    return p, msg


def answer(fill: int = 7, nbytes: int = OUT) -> dict:
    return {"y": (Held("float32", (1, nbytes // 4)), memoryview(bytes([fill]) * nbytes))}


def cache(entries: int = 100, max_bytes: int = 1 << 20, ttl_s: float | None = None) -> ResponseCache:
    return ResponseCache(CacheDecl(entries=entries, max_bytes=max_bytes, ttl_s=ttl_s))


def miss_then_store(c: ResponseCache, data: bytes, now: float = 0.0, **kw) -> Pending:
    p, msg = request(data, **kw)
    assert not c.lookup(p, msg, [0], now)
    c.store(*p.cache_miss[1:], p, answer(data[0]), now)
    return p


def hit(c: ResponseCache, data: bytes, now: float = 0.0, **kw) -> dict | None:
    p, msg = request(data, **kw)
    return p.cache_hit if c.lookup(p, msg, [0], now) else None


def test_a_stored_answer_is_given_again_as_the_answer_path_reads_it():
    c = cache()
    miss_then_store(c, b"\x01" * 16)
    views = hit(c, b"\x01" * 16)
    held, data = views["y"]
    assert held.dtype == "float32" and held.shape == (1, 4) and bytes(data) == b"\x01" * OUT and data.nbytes == OUT
    assert (c.hits, c.misses) == (1, 1) and c.nbytes == OUT + KEY_BYTES and [len(k) for k in c.entries] == [KEY_BYTES]


def test_entries_of_one_layout_share_it_and_keep_one_bytes_object_each():
    c = cache()
    miss_then_store(c, b"a" * 16)
    miss_then_store(c, b"b" * 16)
    first, second = c.entries.values()
    assert first.layout is second.layout and type(first.data) is bytes and first.data == b"a" * OUT


def test_least_recently_used_goes_first_under_the_entry_bound():
    c = cache(entries=2)
    miss_then_store(c, b"a" * 16)
    miss_then_store(c, b"b" * 16)
    assert hit(c, b"a" * 16) is not None          # a is now the most recently used
    miss_then_store(c, b"c" * 16)
    assert hit(c, b"b" * 16) is None and hit(c, b"a" * 16) is not None and hit(c, b"c" * 16) is not None
    assert c.evictions == {"entries": 1} and len(c.entries) == 2


def test_the_byte_bound_counts_outputs_and_keys():
    c = cache(max_bytes=2 * (OUT + KEY_BYTES))
    for fill in b"abc":
        miss_then_store(c, bytes([fill]) * 16)
    assert len(c.entries) == 2 and c.nbytes == 2 * (OUT + KEY_BYTES) and c.evictions == {"bytes": 1}
    assert hit(c, b"a" * 16) is None


def test_an_answer_larger_than_the_whole_cache_is_not_kept():
    c = cache(max_bytes=OUT + KEY_BYTES - 1)
    miss_then_store(c, b"a" * 16)
    assert not c.entries and c.nbytes == 0 and not c.evictions


def test_an_entry_past_its_ttl_is_dropped_when_looked_up():
    c = cache(ttl_s=10.0)
    miss_then_store(c, b"a" * 16, now=100.0)
    assert hit(c, b"a" * 16, now=109.9) is not None
    assert hit(c, b"a" * 16, now=110.0) is None
    assert c.evictions == {"expired": 1} and not c.entries and c.nbytes == 0


@pytest.mark.parametrize("other", [{"version": "2"}, {"dtype": "int32"}, {"shape": (2, 2)}, {"outputs": ("z",)},
                                   {"data": b"\x00" * 15 + b"\x01"}, {"model": "n"}])
def test_the_key_holds_the_version_dtype_shape_outputs_and_bytes(other):
    c = cache()
    miss_then_store(c, bytes(16))
    assert hit(c, bytes(16)) is not None
    assert hit(c, **{"data": bytes(16), **other}) is None


def test_cuda_tensors_bypass_the_cache():
    c = cache()
    p, msg = request(cuda=CudaIpc(device=0, device_uuid="", handle=b"h", storage_bytes=16,
                                   storage_offset_bytes=0))
    assert not c.lookup(p, msg, [0], 0.0) and p.cache_miss is None and c.bypassed == 1 and c.misses == 0


def test_dropping_a_version_takes_its_answers_only_and_refuses_stores_looked_up_before():
    c = cache()
    miss_then_store(c, b"a" * 16, version="1")
    miss_then_store(c, b"a" * 16, version="2")
    late, msg = request(b"b" * 16, version="1")
    assert not c.lookup(late, msg, [0], 0.0)      # computing while its version is retired
    c.drop(["1"])
    c.store(*late.cache_miss[1:], late, answer(), 0.0)
    assert hit(c, b"a" * 16, version="1") is None and hit(c, b"b" * 16, version="1") is None
    assert hit(c, b"a" * 16, version="2") is not None
    assert c.evictions == {"invalidated": 1} and c.nbytes == OUT + KEY_BYTES
    c.clear()
    assert not c.entries and c.nbytes == 0 and c.evictions == {"invalidated": 2}


# ---- in admission, the registry and the config ---------------------------------------------------------------

def model(name: str = "m", versions=("1",), **kw) -> dict:
    return {"name": name, "versions": [{"version": v, "path": "m.pt"} for v in versions],
            "inputs": [{"name": "x", "dtype": "float32", "shape": [4]}],
            "outputs": [{"name": "y", "dtype": "float32", "shape": [4]}], "max_batch_size": 4, **kw}


def config(tmp_path, *models: dict):
    unloaded_model(tmp_path / "m.pt")
    return parse_config({"models": list(models)}, str(tmp_path))


def admission(tmp_path, *models: dict) -> tuple[Admission, Registry, Clock]:
    cfg, clock = config(tmp_path, *models), Clock()
    registry = Registry(cfg.models)
    for entry in registry.models.values():
        for rec in entry.records.values():
            rec.seen = True
    batcher, stats = Batcher(clock), Stats()
    for m in cfg.models:
        batcher.add_model(m.name, m.max_batch_size, m.max_queue, levels=m.priority_levels)
        stats.model(m.name)
    return Admission(cfg.server, cfg.workers, cfg.models, tenants_of(cfg, clock), registry, batcher, stats,
                     Owed(cfg.server.max_inflight_per_client), clock), registry, clock


def admit(adm: Admission, data: bytes, version: str | None = None) -> Pending:
    class Frame(bytes):
        buffer = property(lambda self: memoryview(self))
    msg = Infer(v=PROTOCOL_VERSION, id=1, model="m", version=version,
                inputs=[TensorMeta(name="x", dtype="float32", shape=[1, 4])])
    return adm.admit(b"c", msg, [Frame(data)])


CACHED = {"cache": {"entries": 10, "max_bytes": 4096}}


def test_a_hit_is_admitted_and_leaves_but_is_never_queued(tmp_path):
    adm, registry, clock = admission(tmp_path, model(adaptive_concurrency=True, slo_p99_ms=50, **CACHED))
    first = admit(adm, b"a" * 16)
    assert first.cache_miss is not None and adm.batcher.queued("m") == 1
    registry.models["m"].cache.store(*first.cache_miss[1:], first, answer(), clock())
    again = admit(adm, b"a" * 16)
    assert again.cache_hit is not None and adm.batcher.queued("m") == 1
    assert adm.limits["m"].inflight == 2 and again.record.active == 2
    adm.leave([again], None, clock())
    assert adm.limits["m"].inflight == 1 and again.record.active == 1 and adm.stats.models["m"].requests == 2


def test_the_key_has_the_version_the_split_picked(tmp_path):
    adm, registry, clock = admission(tmp_path, model(versions=("1", "2"), default_version="1", **CACHED))
    p = admit(adm, b"a" * 16)   # names no version: the split's pick, 1
    registry.models["m"].cache.store(*p.cache_miss[1:], p, answer(), clock())
    assert admit(adm, b"a" * 16, version="1").cache_hit is not None
    assert admit(adm, b"a" * 16, version="2").cache_hit is None


def test_a_model_without_a_cache_section_caches_nothing(tmp_path):
    adm, registry, _ = admission(tmp_path, model())
    assert registry.models["m"].cache is None
    p = admit(adm, b"a" * 16)
    assert p.cache_miss is None and p.cache_hit is None


def stored(registry: Registry, version: str, data: bytes = b"a" * 16) -> None:
    c = registry.models["m"].cache
    miss_then_store(c, data, version=version)


def test_a_swap_drops_the_drained_versions_answers_at_once(tmp_path):
    registry = Registry(config(tmp_path, model(versions=("1", "2"), default_version="1", **CACHED)).models)
    stored(registry, "1")
    stored(registry, "2")
    registry.flip("m", {"2": FULL_WEIGHT}, drain=["1"])
    c = registry.models["m"].cache
    assert {e.version for e in c.entries.values()} == {"2"}
    registry.forget("m", ["2"])
    assert not c.entries and c.nbytes == 0


def test_retire_and_remove_drop_answers(tmp_path):
    registry = Registry(config(tmp_path, model(versions=("1", "2"), default_version="1", **CACHED)).models)
    stored(registry, "1")
    stored(registry, "2")
    entry = registry.models["m"]
    registry.retire("m", [entry.records["2"]])
    assert {e.version for e in entry.cache.entries.values()} == {"1"}
    registry.remove("m")
    assert not entry.cache.entries


def test_a_redeclared_cache_starts_empty_and_an_unchanged_one_keeps_its_answers(tmp_path):
    cfg = config(tmp_path, model(**CACHED))
    registry = Registry(cfg.models)
    stored(registry, "1")
    old = registry.models["m"].cache
    registry.redeclare(cfg.models[0].model_copy(update={"timeout_ms": 5}))
    assert registry.models["m"].cache is old and len(old.entries) == 1
    registry.redeclare(cfg.models[0].model_copy(update={"cache": CacheDecl(entries=5, max_bytes=100)}))
    assert not old.entries and registry.models["m"].cache.max_entries == 5
    registry.redeclare(cfg.models[0].model_copy(update={"cache": None}))
    assert registry.models["m"].cache is None


@pytest.mark.parametrize("section, why", [({"entries": 0, "max_bytes": 10}, "entries"),
                                          ({"entries": 1, "max_bytes": 0}, "max_bytes"),
                                          ({"entries": 1, "max_bytes": 10, "ttl_s": 0}, "ttl_s"),
                                          ({"entries": 1}, "max_bytes"),
                                          ({"entries": "1", "max_bytes": 10}, "entries"),
                                          ({"entries": 1, "max_bytes": 10, "size": 3}, "size")])
def test_a_bad_cache_section_is_refused_naming_its_key(tmp_path, section, why):
    with pytest.raises(ConfigError) as info:
        config(tmp_path, model(cache=section))
    assert f"models.0.cache.{why}" in str(info.value)


def test_a_stage_may_not_declare_a_cache(tmp_path):
    stage = {"name": "s", "versions": [{"version": "1", "handler": "tgw.workers.demo_stages:TopK"}],
             "inputs": [{"name": "x", "dtype": "float32", "shape": [4]}],
             "outputs": [{"name": "y", "dtype": "float32", "shape": [4]}], **CACHED}
    with pytest.raises(ConfigError) as info:
        config(tmp_path, stage)
    assert "cache is a model's key" in str(info.value)


def test_a_reload_may_change_the_cache_section(tmp_path):
    from tgw.broker.models.reload import restart_only
    old, new = config(tmp_path, model()), config(tmp_path, model(**CACHED))
    assert restart_only(old, new) == [] and restart_only(new, old) == []
