"""The module size: past 500 lines a product module is a smell to explain (in its docstring, and
listed in EXPLAINED), never a reason to split one concept into parts. (The dependency rule:
tests/unit/test_import_graph.py, and in fresh interpreters tests/process/test_layering.py.)"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("broker", "workers", "shm", "client")
MAX_LINES = 500
# modules past MAX_LINES, each with its docstring saying why (none today)
EXPLAINED: set[str] = set()


def test_module_size_budget():
    sizes = {}
    for d in CODE_DIRS:
        files = sorted((ROOT / d).rglob("*.py"))
        assert files, f"no modules found under {d}/"
        for f in files:
            with open(f, encoding="utf-8") as fh:
                sizes[str(f.relative_to(ROOT))] = sum(1 for _ in fh)
    over = {k: v for k, v in sizes.items() if v > MAX_LINES}
    assert set(over) - EXPLAINED == set(), f"product modules over {MAX_LINES} lines, unexplained: {over}"
    for path in EXPLAINED:
        doc = ast.get_docstring(ast.parse((ROOT / path).read_text(encoding="utf-8"))) or ""
        assert f"{MAX_LINES} lines" in doc, f"{path} is listed in EXPLAINED but its docstring does not say why"
