"""The rollout's safe-change ops (docs/ROLLOUT.md): a shadow load, a policy attached to a canary or
shadow, and the decisions the guards hand the operator - promote or roll back. Rollout (load,
unload, retire) does the moving; this module says what to move and answers in words.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from tgw.shm.errors import Code, fail
from tgw.shm.wire import PROTOCOL_VERSION, ControlReply, LoadVersion, RolloutPolicy, UnloadVersion

from tgw.broker.state.versions import VersionRecord, VersionState
from .registry import FULL_WEIGHT, ModelEntry

PROMOTE, ROLLBACK = "promote", "rollback"


@dataclass(frozen=True)
class GuardHooks:
    """What a guarded load tells the canary wing (filled in by broker/core/assembly.py)."""
    check_policy: Callable[[RolloutPolicy, bool], RolloutPolicy]   # raises INVALID_ARGUMENT (canary/policy.py)
    shadow_of: Callable[[str], Optional[str]]                      # the model's shadow version, if any
    guarded: Callable[[str], Optional[str]]                        # the version its guard watches, if any
    start_shadow: Callable[[str, str, float], object]              # (model, version, fraction)
    watch: Callable[[str, str, str, RolloutPolicy], None]          # (model, version, canary|shadow, policy)
    gone: Callable[..., None]       # (model, versions, why): they left or one was promoted - copies and guard end


@dataclass
class Decision:
    """A guard's verdict for the operator to carry out (never on the wire)."""
    decision: str            # promote or rollback
    model: str
    version: str
    why: str
    figures: dict = field(default_factory=dict)
    id: int = 0


def check_load(hooks: GuardHooks, entry: ModelEntry, msg: LoadVersion) -> None:
    """Refuse a shadow or policy load that cannot be carried out, before anything loads."""
    if msg.shadow is not None:
        if msg.weight is not None:
            raise fail(Code.INVALID_ARGUMENT, "a shadow takes no traffic of its own: give --shadow or --weight, "
                       "not both", model=entry.name, reason="shadow_and_weight")
        if not 0 < msg.shadow <= 1:   # NaN too
            raise fail(Code.INVALID_ARGUMENT, f"shadow must be a fraction in (0, 1], got {msg.shadow!r}",
                       model=entry.name, reason="bad_shadow")
        if entry.decl.is_stage:
            raise fail(Code.INVALID_ARGUMENT, f"{entry.name!r} is a stage: only a model's versions can be "
                       "shadowed", model=entry.name, reason="shadow_stage")
        current = hooks.shadow_of(entry.name)
        if current is not None:
            raise fail(Code.INVALID_ARGUMENT, f"{entry.name!r} already has shadow version {current!r}: unload or "
                       "promote it first (one shadow per model)", model=entry.name, reason="shadow_exists")
    if msg.policy is not None:
        if msg.shadow is None and msg.weight is None:
            raise fail(Code.INVALID_ARGUMENT, "a rollout policy guards a canary (--weight) or a shadow (--shadow); "
                       "a hot swap has nothing left to compare against", model=entry.name, reason="policy_on_swap")
        if msg.weight == 0:
            raise fail(Code.INVALID_ARGUMENT, "a guarded canary needs a weight above 0 (it is judged on its own "
                       "traffic); to judge a version without traffic, load it as a shadow", model=entry.name,
                       reason="policy_without_traffic")
        hooks.check_policy(msg.policy, msg.shadow is not None)
        watched = hooks.guarded(entry.name)
        if watched is not None:
            raise fail(Code.INVALID_ARGUMENT, f"{entry.name!r} already has a guarded rollout of version "
                       f"{watched!r}: one at a time per model", model=entry.name, reason="guard_exists")


def weights_with(entry: ModelEntry, rec: VersionRecord, weight: int) -> dict[str, int]:
    """The ready versions' weights as they are, and `rec` with `weight`."""
    return {**{r.version: r.weight for r in entry.records.values() if r.state is VersionState.READY},
            rec.version: weight}


def started(hooks: GuardHooks, entry: ModelEntry, rec: VersionRecord, msg: LoadVersion) -> str:
    """`rec` loaded and flipped in: start its copies and its guard; what to say of them."""
    said = ""
    if msg.shadow is not None:
        hooks.start_shadow(entry.name, rec.version, float(msg.shadow))
        said = f"{rec.key} loaded as a shadow: {msg.shadow:.1%} of the answered requests are copied to it and " \
               "its outputs compared (`tgw-broker models diff`)"
    if msg.policy is not None:
        hooks.watch(entry.name, rec.version, "shadow" if msg.shadow is not None else "canary", msg.policy)
        said += "; guarded by its rollout policy"
    return said


def promotion(entry: ModelEntry, version: str) -> dict[str, int]:
    """The flip that makes `version` take every request naming no version (a swap)."""
    rec = entry.records.get(version)
    if rec is None or rec.state is not VersionState.READY:
        raise fail(Code.VERSION_NOT_FOUND, f"{entry.name}:{version} is not ready to be promoted",
                   model=entry.name, version=version)
    return {version: FULL_WEIGHT}


async def carry_out(rollout, d: Decision) -> ControlReply:
    """A guard's verdict, by the rollout (models/rollout.py): promote - the version takes every
    request naming no version, the others drain and unload - or roll back - it drains and unloads."""
    entry = rollout.registry.entry(d.model)
    rollout.placement.note(d.decision, f"{d.model}:{d.version}", message=d.why)
    if d.decision == ROLLBACK:
        return decided_reply(d, await rollout.unload(UnloadVersion(v=PROTOCOL_VERSION, model=d.model,
                                                                   version=d.version, id=d.id)))
    since = rollout.placement.seq
    weights = promotion(entry, d.version)
    rollout.check_pipelines(entry, [v for v in entry.routable() if v != d.version and entry.records[v].weight],
                            d.version)
    rollout.d.guards.gone(entry.name, [d.version], "promoted")   # no more copies to it, its guard done
    rollout.registry.mark_shadow(entry.name, d.version, False)
    replaced = rollout.registry.flip(entry.name, weights)
    await rollout.retire(entry, replaced)
    return decided_reply(d, rollout.reply(d, entry, f"{d.version} serves every request that names no version; "
                                          f"{', '.join(r.version for r in replaced) or 'none'} drained and unloaded",
                                          since))


def decided_reply(d: Decision, reply: ControlReply) -> ControlReply:
    reply.message = f"{d.model}:{d.version} {'promoted' if d.decision == PROMOTE else 'rolled back'} ({d.why}): " + \
        reply.message
    reply.details = {**reply.details, "decision": d.decision, "why": d.why, "figures": d.figures}
    return reply
