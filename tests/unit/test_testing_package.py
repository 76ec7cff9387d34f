"""Where tgw.testing and tgw.bench stand (issue 38): the product (broker, workers, shm, client)
imports neither; tgw.testing (bench/testing/) never imports tgw.bench; a scenario is reached
only through `tgw-bench NAME`: no test, harness module or other scenario imports one. Read from
the source, so a function-level import counts too."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("broker", "workers", "shm", "client")


def imports(path: Path) -> set[str]:
    """Every module an import statement of `path` names (`from a import b` also as a.b)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def offenders(files, *prefixes: str) -> list[str]:
    return sorted(f"{f.relative_to(ROOT)}: {name}" for f in files for name in imports(f)
                  if any(name == p or name.startswith(p + ".") for p in prefixes))


def test_the_product_imports_neither_tgw_testing_nor_tgw_bench():
    files = [f for d in PRODUCT for f in (ROOT / d).rglob("*.py")]
    assert files and offenders(files, "tgw.testing", "tgw.bench") == []


def test_tgw_testing_does_not_import_tgw_bench():
    files = list((ROOT / "bench" / "testing").rglob("*.py"))
    assert files and offenders(files, "tgw.bench") == []


def test_no_test_and_no_harness_module_imports_a_scenario():
    scenarios = [f for f in (ROOT / "bench" / "scenarios").glob("*.py") if f.name != "__init__.py"]
    files = [*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench" / "harness").rglob("*.py"), *scenarios]
    assert scenarios and offenders(files, "tgw.bench.scenarios") == []
