"""The product's import graph, read statically from every module (TYPE_CHECKING imports too):
no import circle anywhere, and the broker's wings import only downwards (docs/ARCHITECTURE.md)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"broker": "tgw.broker", "workers": "tgw.workers", "shm": "tgw.shm", "client": "tgw.client"}
# bottom to top: a wing may import config/ and state/ (the foundation) and the wings before it;
# triton_repo/ (Triton repositories read as config entries) lies under config/, which alone imports it
WINGS = ["triton_repo", "config", "state", "cache", "models", "generate", "sequence", "jobs", "sched", "front", "pipeline", "canary", "fleet", "observe", "protocol",
         "faces", "torchserve"]
CORE = "core"   # broker/core/ and broker/cli/ (and anything else outside the wings): the assembly and the command line
# Triton's generated protobuf messages (they import only protobuf): any wing may read them
MESSAGES = "tgw.broker.faces.grpc.proto"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names]
            # `from pkg import mod` depends on mod; `from mod import name` on mod
            targets = subs if all(t in known for t in subs) else [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(f): f for d in PACKAGES for f in (ROOT / d).rglob("*.py")}
    known = set(files)
    # a package's __init__ is not an edge to every module under it: only what it imports itself
    return {name: imports_of(path, name, known) for name, path in files.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def wing_of(name: str) -> str | None:
    parts = name.split(".")
    if parts[:2] != ["tgw", "broker"] or len(parts) < 3 or name.startswith(MESSAGES):
        return None
    return parts[2] if parts[2] in WINGS else CORE


def test_no_import_circle_in_the_product():
    assert circles(graph()) == []


def test_wings_import_only_downwards():
    bad = []
    for name, targets in graph().items():
        wing = wing_of(name)
        if wing is None or wing == CORE:
            continue
        allowed = {"config"} if wing == "state" else set() if wing == "triton_repo" else \
            {"triton_repo"} if wing == "config" else {"config", "state", *WINGS[:WINGS.index(wing)]}
        allowed.add(wing)
        for t in targets:
            other = wing_of(t)
            if other is not None and t != "tgw.broker" and other not in allowed:
                bad.append(f"{name} -> {t}")
    assert bad == []


def face_of(name: str) -> str | None:
    """The face a module belongs to (tgw.broker.faces.NAME...), None outside one."""
    parts = name.split(".")
    return parts[3] if parts[:3] == ["tgw", "broker", "faces"] and len(parts) > 3 else None


def test_no_face_imports_another():
    """Faces stand beside each other: what two share lives in broker/protocol/ (faces/__init__.py)."""
    g = graph()
    assert {face_of(n) for n in g} >= {"http", "grpc"}   # not vacuous: both faces are seen
    crossing = [f"{name} -> {t}" for name, targets in g.items() if face_of(name) is not None
                for t in targets if face_of(t) not in (None, face_of(name))]
    assert crossing == []


def test_the_checker_sees_a_circle_and_an_upward_import():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert wing_of("tgw.broker.core.serving") == CORE and wing_of("tgw.broker.front.door") == "front"
    assert wing_of("tgw.client.client") is None
    assert face_of("tgw.broker.faces.grpc.proto.grpc_service_pb2") == "grpc" and face_of("tgw.broker.faces") is None


def test_no_wing_takes_the_broker():
    """Only the core knows the Broker: no wing imports server.py (checked above) nor names it."""
    takes = re.compile(r"""(:\s*|["'])Broker\b""")   # `b: Broker`, `"Broker"` (a type, not BrokerView)
    named = [str(f.relative_to(ROOT)) for w in WINGS for f in (ROOT / "broker" / w).rglob("*.py")
             if takes.search(f.read_text())]
    assert named == []
