"""What status, /metrics and `tgw-broker status` show of generators (broker/observe/status.py
generation, metrics.py generator_families, cli/main.py generation_line), read from the
GeneratorCounters the generate wing writes (broker/state/generation.py); end to end with a real
broker and worker: tests/process/test_client_generate.py."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tgw.broker.cli import main as cli
from tgw.broker.observe.metrics import generator_families
from tgw.broker.observe.status import generation
from tgw.broker.state.generation import GeneratorCounters
from tgw.shm.wire import PROTOCOL_VERSION, StatusReply


def entry(name: str, generator: bool, removed: bool = False):
    return SimpleNamespace(name=name, is_generator=generator, removed=removed)


def counted() -> GeneratorCounters:
    c = GeneratorCounters(active=3, slots=8, started=7, outputs=40, resumed=1, freed_by_cancel=2, steps=12,
                          ended=Counter({"max_outputs": 3, "cancelled": 1}))
    c.first_output.observe(0.004)
    c.first_output.observe(0.006)
    c.between_outputs.observe(0.002, n=37)
    return c


VIEW = SimpleNamespace(models={"gpt": entry("gpt", True), "quiet": entry("quiet", True), "mlp": entry("mlp", False),
                               "old": entry("old", True, removed=True)},
                       generators={"gpt": counted()})


def test_status_shows_each_generators_counters_and_none_for_other_models():
    g = generation(VIEW, VIEW.models["gpt"])
    assert {k: g[k] for k in ("active", "slots", "occupancy", "outputs", "resumed", "freed_by_cancel", "ended")} == \
        {"active": 3, "slots": 8, "occupancy": 0.375, "outputs": 40, "resumed": 1, "freed_by_cancel": 2,
         "ended": {"max_outputs": 3, "cancelled": 1}}
    assert g["first_output_ms"] == 5.0 and g["between_outputs_ms"] == 2.0
    assert generation(VIEW, VIEW.models["quiet"]) == GeneratorCounters().as_dict()   # nothing counted yet: zeros
    assert generation(VIEW, VIEW.models["mlp"]) is None


class One:
    def __init__(self, fams):
        self.fams = fams

    def collect(self):
        return iter(self.fams)


def test_metrics_families_per_generator_model():
    registry = CollectorRegistry(auto_describe=False)
    registry.register(One(list(generator_families(VIEW))))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert set(fams) == {"tgw_generator_active_sequences", "tgw_generator_slots", "tgw_generator_outputs",
                         "tgw_generator_sequences", "tgw_generator_resumed", "tgw_generator_first_output_seconds",
                         "tgw_generator_between_outputs_seconds"}

    def sample(name, **labels):
        return {s.value for f in fams.values() for s in f.samples
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())}
    assert sample("tgw_generator_active_sequences", model="gpt") == {3}
    assert sample("tgw_generator_slots", model="gpt") == {8}
    assert sample("tgw_generator_outputs_total", model="gpt") == {40}
    assert sample("tgw_generator_sequences_total", model="gpt", reason="cancelled") == {1}
    assert sample("tgw_generator_resumed_total", model="gpt") == {1}
    assert sample("tgw_generator_first_output_seconds_count", model="gpt") == {2}
    assert sample("tgw_generator_between_outputs_seconds_count", model="gpt") == {37}
    assert sample("tgw_generator_outputs_total", model="quiet") == {0}    # a generator not counted yet
    assert not sample("tgw_generator_outputs_total", model="mlp") and not sample("tgw_generator_slots", model="old")


def test_status_printout_has_a_line_per_generator(capsys):
    models = {name: {"ready": True, "queued": 0, "requests": 5, "replies": 5, "errors": {}, "cache": None,
                     "generation": generation(VIEW, m)} for name, m in VIEW.models.items() if not m.removed}
    cli.print_status("ipc:///tmp/x.sock", StatusReply(v=PROTOCOL_VERSION, id=1, phase="serving", uptime_s=4.0,
                                                      workers=[], models=models))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("generator ")]
    assert len(lines) == 2 and lines[0].startswith("generator gpt: 3/8 slots busy, 40 outputs (")
    assert "first output 5.0 ms, between outputs 2.0 ms (means), resumed 1, freed by cancel 2, ended " \
           "{'max_outputs': 3, 'cancelled': 1}" in lines[0]
    assert lines[1].startswith("generator quiet: 0/0 slots busy, 0 outputs")
