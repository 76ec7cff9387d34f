"""The worker package's shape: no module imports another that imports it back (counting imports
inside functions, the usual way a circle is hidden), and every module stays within 500 lines (a smell
to explain, not a reason to split)."""
from __future__ import annotations

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(ROOT, "workers")
MAX_LINES = 500


def modules() -> dict[str, str]:
    return {os.path.basename(p)[:-3]: p for p in sorted(glob.glob(os.path.join(WORKERS, "*.py")))}


def imports(path: str, names: set[str]) -> set[str]:
    """The workers modules `path` imports, anywhere in it (relative or as tgw.workers.X)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tgw.workers."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.ImportFrom) and node.module == "tgw.workers":
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("tgw.workers.")}
    return found & names


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, each as the path that closes it (a -> b -> a)."""
    found, done = [], set()

    def walk(path: list[str]) -> None:
        for nxt in sorted(graph[path[-1]]):
            if nxt in path:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                walk(path + [nxt])
        done.add(path[-1])

    for name in sorted(graph):
        if name not in done:
            walk([name])
    return found


def test_no_import_circle_among_worker_modules():
    mods = modules()
    graph = {name: imports(path, set(mods)) for name, path in mods.items()}
    assert "cuda_ipc" in graph["serve"]   # the reader sees real edges
    assert circles(graph) == []


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_every_worker_module_is_within_500_lines():
    sizes = {}
    for name, path in modules().items():
        with open(path, encoding="utf-8") as f:
            sizes[name] = sum(1 for _ in f)
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
