"""bench/cpu_split.py: every step it names exists in this tree (a renamed method would silently
drop out of the split), and it counts thread CPU only while its window is open."""
from __future__ import annotations

import importlib
import json

from tgw.bench import cpu_split


def test_every_step_it_names_is_wrapped_in_this_tree(monkeypatch):
    for _, module, cls, method in cpu_split.STEPS:   # monkeypatch puts each original back afterwards
        klass = getattr(importlib.import_module(module), cls)
        if hasattr(klass, method):
            monkeypatch.setattr(klass, method, getattr(klass, method))
    labels = list(dict.fromkeys(label for label, _, _, _ in cpu_split.STEPS))
    assert cpu_split.Split().install() == labels


def test_counts_only_while_its_window_is_open(tmp_path, capsys):
    reads = iter(range(0, 10 ** 6, 5000))   # each clock read 5 us after the last
    split = cpu_split.Split(clock=lambda: next(reads))
    twice = split._wrap(lambda x: 2 * x, split.totals.setdefault("  infer (after the header is read)", [0, 0]))
    path = str(tmp_path / "split.json")
    assert twice(2) == 4 and split.totals["  infer (after the header is read)"] == [0, 0]
    split.toggle(path)
    assert twice(1) == 2 and twice(3) == 6
    split.toggle(path)
    twice(5)   # closed again: not counted
    assert json.load(open(path)) == {"  infer (after the header is read)": [10_000, 2]}
    cpu_split.report(path, requests=2, main_us=1.0)
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.split() == ["5.0", "1.000", "infer", "(after", "the", "header", "is", "read)"]   # 10 us over 2
