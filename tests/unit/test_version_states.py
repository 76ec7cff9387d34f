"""A version's life (broker/state/versions.py) and the registry as the one writer of models and
versions (broker/models/registry.py): each legal edge, each illegal one refused with nothing
changed, and the generation bumped by every write (what admission's memo keys on)."""
from __future__ import annotations

import pytest

from conftest import unloaded_model
from tgw.broker.config.load import parse_config
from tgw.broker.config.schema import VersionDecl
from tgw.broker.models.registry import FULL_WEIGHT, Registry
from tgw.broker.state.pool import IllegalTransition
from tgw.broker.state.versions import IllegalVersionTransition, VersionRecord, VersionState

LOADING, READY, DRAINING = VersionState.LOADING, VersionState.READY, VersionState.DRAINING
IO = {"inputs": [{"name": "x", "dtype": "float32", "shape": [2]}],
      "outputs": [{"name": "y", "dtype": "float32", "shape": [2]}]}


def model(name: str, versions: list[str], **extra) -> dict:
    return {"name": name, "versions": [{"version": v, "path": f"{name}{v}.pt"} for v in versions], **IO, **extra}


@pytest.fixture
def cfg_dir(tmp_path):
    for name in ("a1.pt", "a2.pt", "b1.pt", "c1.pt"):
        unloaded_model(tmp_path / name)
    return tmp_path


@pytest.fixture
def reg(cfg_dir) -> Registry:
    """"a": versions 1 (the default) and 2, both ready; "b": version 1."""
    return Registry(parse_config({"models": [model("a", ["1", "2"], default_version="1"), model("b", ["1"])]},
                                 base_dir=str(cfg_dir)).models)


def states(reg: Registry, name: str = "a") -> dict[str, tuple[str, int]]:
    return {v: (r.state.value, r.weight) for v, r in reg.models[name].records.items()}


def new(version: str) -> VersionDecl:
    return VersionDecl(version=version, path=f"/m/{version}.pt")


class Bumps:
    """Asserts the block bumped the registry's generation (or, `by=0`, did not)."""

    def __init__(self, reg: Registry, by: int | None = None):
        self.reg, self.by = reg, by

    def __enter__(self):
        self.before = self.reg.generation

    def __exit__(self, *exc):
        grew = self.reg.generation - self.before
        assert (grew == self.by) if self.by is not None else grew > 0, f"generation moved by {grew}"


# ---- the record's edges ----------------------------------------------------------------------------

def record(state: VersionState) -> VersionRecord:
    return VersionRecord("m", new("1"), state)


def test_loading_to_ready_makes_it_routable_with_its_weight():
    rec = record(LOADING)
    rec.ready(7)
    assert (rec.state, rec.weight, rec.seen) == (READY, 7, True)


def test_ready_again_changes_only_the_weight():
    rec = record(READY)
    rec.ready(3)
    assert (rec.state, rec.weight) == (READY, 3)


@pytest.mark.parametrize("start", [LOADING, READY])
def test_loading_or_ready_drains_and_loses_its_weight(start):
    rec = record(start)
    rec.weight = 5
    rec.drain()
    assert (rec.state, rec.weight) == (DRAINING, 0)


@pytest.mark.parametrize("move", ["ready", "drain"])
def test_a_draining_version_goes_nowhere(move):
    rec = record(DRAINING)
    with pytest.raises(IllegalVersionTransition, match="draining -> "):
        rec.ready(1) if move == "ready" else rec.drain()
    assert rec.state is DRAINING and rec.weight == 0


def test_the_error_is_a_transition_error_and_state_has_no_setter():
    assert issubclass(IllegalVersionTransition, IllegalTransition)
    rec = record(READY)
    with pytest.raises(AttributeError):
        rec.state = DRAINING
    assert rec.state is READY


# ---- the registry's writes: models ---------------------------------------------------------------

def test_the_hand_made_invalidation_is_gone(reg):
    assert not hasattr(reg, "changed")


def test_declare_adds_a_model_without_versions(reg, cfg_dir):
    c = parse_config({"models": [model("c", ["1"])]}, base_dir=str(cfg_dir)).models[0]
    with Bumps(reg):
        entry = reg.declare(c)
    assert reg.models["c"] is entry and entry.records == {} and not entry.traffic
    with Bumps(reg, by=0), pytest.raises(IllegalVersionTransition, match="declared already"):
        reg.declare(c)


def test_redeclare_replaces_the_declaration(reg):
    decl = reg.models["a"].decl.model_copy(update={"timeout_ms": 1234})
    with Bumps(reg):
        reg.redeclare(decl)
    assert reg.models["a"].decl.timeout_ms == 1234


def test_remove_refuses_the_model_and_keeps_its_versions_until_forgotten(reg):
    with Bumps(reg):
        recs = reg.remove("b")
    assert [r.key for r in recs] == ["b:1"] and "b" in reg.models
    with pytest.raises(Exception, match="no model named 'b'"):
        reg.entry("b")
    with Bumps(reg):
        reg.forget("b")
    assert "b" not in reg.models
    with Bumps(reg, by=0):
        reg.forget("b")    # gone already: no error, nothing written


def test_writes_to_an_undeclared_model_are_refused(reg):
    with Bumps(reg, by=0):
        for write in (lambda: reg.add_version("zz", new("1")), lambda: reg.flip("zz", {"1": 1}),
                      lambda: reg.weigh("zz", {}), lambda: reg.remove("zz"), lambda: reg.retire("zz", [])):
            with pytest.raises(IllegalVersionTransition, match="no model 'zz'"):
                write()


# ---- the registry's writes: versions -------------------------------------------------------------

def test_add_version_starts_loading_and_unroutable(reg):
    with Bumps(reg):
        rec = reg.add_version("a", new("3"))
    assert rec.state is LOADING and reg.models["a"].records["3"] is rec and "3" not in reg.models["a"].routable()
    with Bumps(reg, by=0), pytest.raises(IllegalVersionTransition, match="exists already"):
        reg.add_version("a", new("3"))


def test_a_swap_flips_to_the_new_version_and_drains_those_that_had_weight(reg):
    reg.add_version("a", new("3"))
    with Bumps(reg):
        drained = reg.flip("a", {"3": FULL_WEIGHT})
    assert [r.version for r in drained] == ["1"]
    assert states(reg) == {"1": ("draining", 0), "2": ("ready", 0), "3": ("ready", FULL_WEIGHT)}
    assert reg.models["a"].records["3"].seen and reg.models["a"].traffic.versions == ["3"]


def test_a_canary_flip_keeps_the_others_ready(reg):
    reg.add_version("a", new("3"))
    with Bumps(reg):
        drained = reg.flip("a", {"1": 100, "3": 10})
    assert drained == []
    assert states(reg) == {"1": ("ready", 100), "2": ("ready", 0), "3": ("ready", 10)}


def test_a_flip_drains_the_versions_named_to_drain(reg):
    reg.add_version("a", new("3"))
    with Bumps(reg):
        drained = reg.flip("a", {"3": 0}, drain=["1", "2"])   # a reload: the file lists only 3
    assert {r.version for r in drained} == {"1", "2"}
    assert states(reg) == {"1": ("draining", 0), "2": ("draining", 0), "3": ("ready", FULL_WEIGHT)}


def test_flipping_a_draining_version_is_refused_and_changes_nothing(reg):
    reg.retire("a", [reg.models["a"].records["2"]])
    reg.add_version("a", new("3"))
    before = states(reg)
    with Bumps(reg, by=0), pytest.raises(IllegalVersionTransition, match="a:2: draining -> ready"):
        reg.flip("a", {"3": 50, "2": 50})   # 3 is checked first and fine: still not flipped
    assert states(reg) == before and reg.models["a"].records["3"].state is LOADING


def test_flipping_a_loading_version_of_another_model_is_refused(reg):
    reg.add_version("b", new("3"))
    with Bumps(reg, by=0), pytest.raises(IllegalVersionTransition, match="flip of a: it has no version '3'"):
        reg.flip("a", {"3": FULL_WEIGHT})
    assert reg.models["b"].records["3"].state is LOADING


def test_draining_a_version_the_model_lacks_is_refused(reg):
    with Bumps(reg, by=0), pytest.raises(IllegalVersionTransition, match="no version '9' to drain"):
        reg.flip("a", {"1": 1}, drain=["9"])


def test_retire_drains_and_tolerates_what_is_draining_or_gone(reg):
    records = list(reg.models["a"].records.values())
    with Bumps(reg):
        assert reg.retire("a", records[:1]) == records[:1]
    assert states(reg) == {"1": ("draining", 0), "2": ("ready", FULL_WEIGHT)}  # the newest takes the traffic
    reg.forget("a", ["2"])
    with Bumps(reg):
        reg.retire("a", records)   # 1 drains already, 2 is forgotten: neither is an error
    assert states(reg) == {"1": ("draining", 0)} and records[1].state is READY


def test_retiring_another_models_version_is_refused(reg):
    other = reg.models["b"].records["1"]
    with Bumps(reg, by=0), pytest.raises(IllegalVersionTransition, match="another model's version"):
        reg.retire("a", [other])
    assert other.state is READY


def test_weigh_sets_the_ready_versions_weights(reg):
    with Bumps(reg):
        reg.weigh("a", {"2": 3})
    assert states(reg) == {"1": ("ready", 0), "2": ("ready", 3)}
    assert reg.models["a"].default == "2"


def test_weighing_a_version_that_is_not_ready_is_refused(reg):
    reg.add_version("a", new("3"))
    with Bumps(reg, by=0), pytest.raises(IllegalVersionTransition, match=r"\['3'\] not ready"):
        reg.weigh("a", {"1": 1, "3": 1})
    assert states(reg)["1"] == ("ready", FULL_WEIGHT)


def test_forget_takes_versions_out_in_any_state(reg):
    reg.add_version("a", new("3"))
    reg.retire("a", [reg.models["a"].records["1"]])
    with Bumps(reg):
        reg.forget("a", ["1", "3", "9"])    # draining, loading, and one never there
    assert list(reg.models["a"].records) == ["2"] and reg.models["a"].traffic.versions == ["2"]
