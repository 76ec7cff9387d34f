"""Each device's state, as `status`, health (/v2/health/ready) and /metrics show it.

A device (cuda:N, a MIG instance as CUDA_VISIBLE_DEVICES lists it, or cpu) is:
  serving         a worker on it is ready;
  starting        its first worker is loading its models (the broker is starting);
  restarting      its worker is starting again (or waits for its next start);
  faulted         its worker met a sticky CUDA error and is being replaced;
  out_of_service  repeated faults took it out (supervisor.cuda_faults), no worker starts there.
The box is ready while every model is served somewhere (status.serving); a device that does not
serve lists the models that lose capacity with it.
"""
from __future__ import annotations

from tgw.broker.fleet.faults import FAULT_PREFIX
from tgw.broker.models.roles import serves
from tgw.broker.state.pool import WorkerState

DEVICE_STATES = ("serving", "starting", "restarting", "faulted", "out_of_service")
RANK = {"serving": 3, "faulted": 2, "restarting": 1, "starting": 0}


def worker_device_state(w) -> str:
    if w.state is WorkerState.READY and not w.faulted:
        return "serving"
    if w.faulted or (w.last_death.startswith(FAULT_PREFIX) and w.state is not WorkerState.READY):
        return "faulted"
    return "starting" if w.generation == 0 and not w.last_death else "restarting"


def device_states(view) -> dict[str, dict]:
    """Device -> state, uuid, its workers, faults since start, why it does not serve, and the
    models that lose capacity while it does not. `view`: status.BrokerView (roster, models,
    faults), not imported: status imports this module."""
    faults = view.faults()
    out_of_service, counts = faults.get("out_of_service", {}), faults.get("by_device", {})
    out: dict[str, dict] = {}
    for w in view.roster:
        d = out.setdefault(w.device, {"state": "", "uuid": "", "workers": [], "faults": counts.get(w.device, 0),
                                      "reason": "", "models_lost": [], "_roles": set()})
        d["uuid"] = d["uuid"] or w.device_uuid
        d["workers"].append(w.name)
        d["_roles"].add(w.role)
        state = worker_device_state(w)   # the best of its workers' (one that serves makes it serve)
        if not d["state"] or RANK[state] > RANK[d["state"]]:
            d["state"] = state
            d["reason"] = "" if state == "serving" else w.faulted or w.benched or w.last_death
    for device, held in out_of_service.items():
        d = out.get(device)
        if d is not None and d["state"] != "serving":
            d["state"], d["reason"] = "out_of_service", f"{held['reason']}; next start in {held['left_s']:g} s"
    for device, d in out.items():
        roles = d.pop("_roles")
        if d["state"] != "serving":
            d["models_lost"] = sorted(m.name for m in view.models.values() if not m.removed and any(
                serves(r, device, m.decl.is_stage, m.decl.device) for r in roles))
    return out


def missing(devices: dict[str, dict]) -> list[str]:
    """One line per device that does not serve: what capacity is missing, and why."""
    return [f"{device} is {d['state']}" + (f" ({d['reason']})" if d["reason"] else "") +
            (f": {', '.join(d['models_lost'])} served without it" if d["models_lost"] else "")
            for device, d in devices.items() if d["state"] != "serving"]
