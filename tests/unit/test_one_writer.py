"""One writer per state: a worker handle's fields (and its Holding's) change only in
broker/state/pool.py, through methods named for what happened (issue 38). Read statically: no
other broker module assigns to them, augments them or calls a mutating method on them through
the names the broker gives a worker (w, worker, old, new, handle) or its holding."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from tgw.broker.state.pool import Holding, WorkerHandle

ROOT = Path(__file__).resolve().parents[2]
OWNER = ROOT / "broker" / "state" / "pool.py"
WORKER_NAMES = {"w", "worker", "old", "new", "handle"}
MUTATORS = {"add", "discard", "remove", "clear", "pop", "popitem", "update", "append", "extend", "setdefault",
            "difference_update", "intersection_update", "alloc", "release"}
# the fields a life sets up (WorkerHandle._use_ring), beside the dataclass's own
RING_FIELDS = {"inputs", "releases", "holding", "sizes", "footprints"}
FIELDS = {f.name for f in dataclasses.fields(WorkerHandle)} | RING_FIELDS | {"state", "_state"}
HOLDING = {f.name for f in dataclasses.fields(Holding)}


def field_of(node: ast.AST) -> str | None:
    """`w.budget`, `w.sizes[k]`, `w.holding.wanted`, `h.loading[k]` (h = w.holding) -> the field's name."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if not isinstance(node, ast.Attribute):
        return None
    base = node.value
    if isinstance(base, ast.Name) and base.id in WORKER_NAMES and node.attr in FIELDS:
        return node.attr
    holding = (isinstance(base, ast.Attribute) and base.attr == "holding") or \
        (isinstance(base, ast.Name) and base.id == "h")
    if holding and node.attr in HOLDING:
        return f"holding.{node.attr}"
    return None


def writes(source: str, where: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        for t in targets:
            for one in (t.elts if isinstance(t, ast.Tuple) else [t]):
                name = field_of(one)
                if name is not None:
                    out.append(f"{where}:{node.lineno} {name}")
    return out


def test_only_the_pool_writes_a_worker_handle():
    found = [w for path in sorted((ROOT / "broker").rglob("*.py")) if path != OWNER
             for w in writes(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert found == [], "worker-handle fields written outside broker/state/pool.py"


def test_the_checker_sees_each_kind_of_write():
    source = ("w.budget = 1\nworker.sizes[k] += 2\nold.holding.wanted.add(k)\nh.loading.pop(k)\n"
              "w.pid, w.proc = 1, None\nlimit.inflight += 1\nw.models.copy()\nx = w.retiring\n")
    assert sorted(x.split(" ")[1] for x in writes(source, "probe")) == \
        ["budget", "holding.loading", "holding.wanted", "pid", "proc", "sizes"]
