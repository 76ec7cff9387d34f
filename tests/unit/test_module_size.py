"""The module size budget: 500 lines for every product module (a smell to explain, never a reason
to split one concept). (The dependency rule: tests/unit/test_import_graph.py, and in fresh
interpreters tests/process/test_layering.py.)"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("broker", "workers", "shm", "client")


def test_module_size_budget():
    sizes = {}
    for d in CODE_DIRS:
        files = sorted((ROOT / d).rglob("*.py"))
        assert files, f"no modules found under {d}/"
        for f in files:
            with open(f, encoding="utf-8") as fh:
                sizes[str(f.relative_to(ROOT))] = sum(1 for _ in fh)
    over = {k: v for k, v in sizes.items() if v > 500}
    assert over == {}, f"product modules over 500 lines: {over}"
