"""The house's figures (issue 38, "Measured"): what the code's shape is, read from the code itself.

    .venv/bin/python scripts/house-figures.py                     # the table; ~15 s on 2 cores
    .venv/bin/python scripts/house-figures.py --json out.json     # ... and every figure and list as JSON
    .venv/bin/python scripts/house-figures.py --static            # without the traced broker (seconds)

Run it before and after a change to the house and compare the two JSON files. Everything but
figure 6 is read statically from the source (ast, no import of tgw); figure 6 starts a real broker.
Past 500 lines on purpose: nine independent read-outs, one file so that `--root DIR` can measure
any checkout (an older one included) with no install, and no figure's code depends on another's.
"Product packages" are tgw.broker, tgw.workers, tgw.shm and tgw.client; tgw.X is found in the
folder pyproject.toml's [tool.setuptools] package-dir names.

1. modules and lines (physical lines) of broker/ (its generated gRPC stubs, any folder named
   `proto`, counted apart), workers/, shm/, client/ and bench/ (without bench/testing/).
2. imports: the module graph of the product packages from the AST. Every `import`/`from ... import`
   counts, at module level or inside a function, except those under `if TYPE_CHECKING:` (they
   never run); relative imports are resolved; a name taken from a package's `__init__` that the
   `__init__` only re-exports is an edge to the module that defines it; importing a module does
   not add edges to its parent packages. Circles = strongly connected components of more than one
   module (listed). Depth = the most modules on one import chain (a circle counts as one).
   Also: imports from a gRPC module (a path part starting "grpc", not `proto`) of an HTTP one
   (a path part starting "http").
3. modules naming the `Broker` (the class `Broker` defined in broker/): every other product module
   with the identifier `Broker` in its code (a name, an attribute, an import, a string
   annotation); docstrings, comments and other strings do not count, nor longer names (BrokerProc).
4. late binding in assembly: assembly = broker/core/**/*.py if broker/core/ exists, else
   broker/{server,main,wiring,lifecycle}.py. `lambda` expressions and `getattr` calls with three
   arguments (the `getattr(b, "x", None)` guards), per file.
5. the config's stays and climbs from `run_broker` (the `def run_broker` found in broker/), a static
   flow analysis over broker/ (without proto/):
   * "the Config" is run_broker's Config parameter (the one annotated Config, else the first) and
     every value the analysis shows to be it: a parameter it was passed to, a local name or a
     `self.attr` it was assigned to (an attribute holds it for every method of the class), a
     name assigned into such an attribute (a reload's new config becomes the config), the result of
     a call to a function annotated `-> Config`, and names closed over by nested functions.
     A "section" is `<the Config>.<field>` for a public field of the class Config (cfg.server,
     cfg.workers, cfg.models, ...) and the names and attributes it is assigned to; deeper values
     (cfg.server.port, a model of cfg.models) are neither.
   * calls are resolved to definitions in broker/: a name (nested def, module def, imported name,
     re-exports followed), `Class(...)` -> `Class.__init__` (a dataclass without one: its
     fields), `super().m`, `self.m` (the class and its bases), `module.f`, `obj.m` where obj's
     class is known (an annotated parameter, `x = Class(...)`, `self.x = ...` of those), a field
     of a record class (dataclass) that holds a callback -> every function or lambda bound to that
     field (`Record(field=...)` and the default); otherwise `obj.m` by the one method named m in
     broker/ when it is unique, else by the callbacks bound to the name m (keyword arguments and
     `x.m = ...` assignments whose value is a lambda or a function) when nothing defines a method m.
   * a "stay" is a function, method or lambda that receives the whole Config as an argument
     (positional or keyword) on such a path; run_broker is the first. Counted: distinct
     functions and their files. A "move" is one (caller, callee) pair that passes it.
   * a "climb" is a move from a caller in file F to a callee in file G != F where G's module
     imports F's, directly or transitively (the config travels back up the import graph: a
     callback into a higher module).
   * the same, separately, for the sections ("a section"): functions receiving a section.
   Calls that pass the Config to something unresolved are listed (not stays).
6. files one request crosses (dynamic): a real broker (the `mlp` demo model, one CPU worker, an
   HTTP face on port 0) runs under `sys.setprofile`/`threading.setprofile`, counting Python
   function calls per file of broker/. After 20 unmeasured requests of each kind, N=200
   sequential native requests (tgw.client, each waits for its answer, so each is its own batch),
   then an idle window as long; a file is crossed when its calls grew by at least 0.95 N more in
   the request window than in the idle one (once a request, less timer noise: a file each request
   calls exactly once must not drop out for one timer's call). Then the same for 200 sequential
   KServe v2 HTTP infer requests (urllib, JSON). The broker is stopped by SIGTERM (its PID) and
   must exit 0 and leave no segment in /dev/shm (both reported).
7. bench: modules under bench/ (without bench/testing/); entry points = [project.scripts] entries
   into tgw.bench, modules with `if __name__ == "__main__"`; scenarios = the names `tgw-bench NAME`
   accepts (read from the console script's own argparse parser, in a child process).
8. tests importing bench: tests/**/*.py with an import of a tgw.bench module (AST, any level);
   those importing a scenario: tgw.bench.scenarios.* once bench/scenarios/ exists, before that
   any tgw.bench module but tgw.bench.cli. Tests that name tgw.bench only in a string (a `-m`
   command line, a preload) are listed apart.
9. writers of the worker handle (the class `WorkerHandle` in broker/): its fields (dataclass
   fields and every `self.x = ...` in its methods) and, per field, the product modules that write
   it: `e.f = / += ...`, `e.f[k] = ...`, `del e.f[...]`, or a call of a mutating method on it
   (append, extend, pop, popitem, clear, update, add, discard, remove, insert, setdefault). The
   receiver `e` must be the handle: `self` inside WorkerHandle's class (its own module), or a name
   or attribute the product gives a handle (any parameter, annotated assignment or field annotated
   WorkerHandle, `WorkerHandle | None`: w, worker, ...). Writes of a field's name on other
   receivers (a tenant's `inflight`, `self` in another class) are listed apart, not counted.

`--root DIR` reads another checkout's source (the static figures only: figure 6 runs the installed tgw).
"""
from __future__ import annotations

import argparse
import ast
import builtins
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT = ("tgw.broker", "tgw.workers", "tgw.shm", "tgw.client")
DEFAULT_DIRS = {"tgw.broker": "broker", "tgw.workers": "workers", "tgw.shm": "shm", "tgw.client": "client",
                "tgw.bench": "bench"}
ASSEMBLY_BEFORE = ("server.py", "main.py", "wiring.py", "lifecycle.py")
MUTATORS = {"append", "extend", "pop", "popitem", "clear", "update", "add", "discard", "remove", "insert",
            "setdefault"}
N_REQUESTS = 200
CROSSED = 0.95   # a file is crossed when the requests called it N times more than the idle window (less timer noise)
BUILTINS = set(vars(builtins))


# ---- the source tree ------------------------------------------------------------------------------

def package_dirs(root: str) -> dict[str, str]:
    """tgw.X -> its folder (relative to root), from pyproject.toml's package-dir."""
    path = os.path.join(root, "pyproject.toml")
    if os.path.exists(path):
        with open(path, "rb") as f:
            data = tomllib.load(f)
        dirs = data.get("tool", {}).get("setuptools", {}).get("package-dir", {})
        if dirs:
            return {k: v.rstrip("/") for k, v in dirs.items()}
    return dict(DEFAULT_DIRS)


def py_files(root: str, folder: str) -> list[str]:
    """*.py under root/folder, relative to root, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, folder)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        out += [os.path.relpath(os.path.join(dirpath, n), root) for n in filenames if n.endswith(".py")]
    return sorted(out)


def is_proto(rel: str) -> bool:
    return "proto" in rel.split(os.sep)[:-1]


class Module:
    def __init__(self, name: str, rel: str, source: str):
        self.name, self.rel, self.source = name, rel, source
        self.tree = ast.parse(source, rel)
        self.is_package = rel.endswith("__init__.py")
        self.lines = len(source.splitlines())

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


class Tree:
    """Every module of the packages pyproject names: module name <-> file, parsed once."""

    def __init__(self, root: str):
        self.root = root
        self.dirs = package_dirs(root)
        self.modules: dict[str, Module] = {}
        self.by_rel: dict[str, Module] = {}
        # the deepest package folder owns a file (tgw.testing in bench/testing/ is not tgw.bench.testing)
        owners = sorted(self.dirs.items(), key=lambda kv: -len(kv[1]))
        for pkg, folder in self.dirs.items():
            for rel in py_files(root, folder):
                owner = next(p for p, d in owners if (rel + "/").startswith(d + "/") or rel.startswith(d + os.sep))
                if owner != pkg:
                    continue
                inner = os.path.relpath(rel, folder)[:-3].split(os.sep)
                if inner[-1] == "__init__":
                    inner = inner[:-1]
                name = ".".join([pkg, *inner])
                with open(os.path.join(root, rel), encoding="utf-8") as f:
                    m = Module(name, rel, f.read())
                self.modules[name] = m
                self.by_rel[rel] = m

    def folder(self, pkg: str) -> str:
        return self.dirs.get(pkg, pkg.split(".")[-1])

    def in_package(self, pkgs) -> list[Module]:
        return [m for n, m in sorted(self.modules.items()) if any(n == p or n.startswith(p + ".") for p in pkgs)]

    # ---- import resolution ----

    def absolute(self, mod: Module, level: int, name: str | None) -> str:
        if level == 0:
            return name or ""
        base = mod.package.split(".")
        if level > 1:
            base = base[:len(base) - (level - 1)]
        return ".".join(base + ([name] if name else []))

    def module_of(self, dotted: str) -> str | None:
        """The longest prefix of `dotted` that is one of our modules."""
        parts = dotted.split(".")
        for k in range(len(parts), 0, -1):
            cand = ".".join(parts[:k])
            if cand in self.modules:
                return cand
        return None

    def defining_module(self, modname: str, name: str, through_all: bool, seen=None) -> str:
        """Where `name`, taken from module `modname`, is defined: re-exports followed (through
        every module with through_all, else through package __init__s only)."""
        seen = seen or set()
        if (modname, name) in seen or modname not in self.modules:
            return modname
        seen.add((modname, name))
        m = self.modules[modname]
        if not (through_all or m.is_package):
            return modname
        for node in m.tree.body:
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if (a.asname or a.name) == name:
                        src = self.absolute(m, node.level, node.module)
                        sub = f"{src}.{a.name}"
                        if sub in self.modules:
                            return sub
                        if src in self.modules:
                            return self.defining_module(src, a.name, through_all, seen)
        return modname


def type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (imports that never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                for stmt in node.body:
                    out |= {id(n) for n in ast.walk(stmt)}
    return out


def imports_of(tree: Tree, m: Module) -> set[str]:
    """The modules of `tree` that module m imports (see figure 2)."""
    skip = type_checking_nodes(m.tree)
    out: set[str] = set()
    for node in ast.walk(m.tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                target = tree.module_of(a.name)
                if target:
                    out.add(target)
        elif isinstance(node, ast.ImportFrom):
            src = tree.absolute(m, node.level, node.module)
            for a in node.names:
                if f"{src}.{a.name}" in tree.modules:
                    out.add(f"{src}.{a.name}")
                elif src in tree.modules:
                    out.add(tree.defining_module(src, a.name, through_all=False))
                else:
                    target = tree.module_of(src)
                    if target:
                        out.add(target)
    out.discard(m.name)
    return out


def import_graph(tree: Tree, pkgs=PRODUCT) -> dict[str, set[str]]:
    mods = {m.name for m in tree.in_package(pkgs)}
    return {n: {t for t in imports_of(tree, tree.modules[n]) if t in mods} for n in sorted(mods)}


def sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on, stack, out = set(), [], []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def depth_and_chain(graph: dict[str, set[str]], comps: list[list[str]]) -> tuple[int, list[str]]:
    """The most condensed nodes on one import chain, and that chain (a circle shown by its first module)."""
    comp_of = {n: i for i, c in enumerate(comps) for n in c}
    succ = defaultdict(set)
    for v, ws in graph.items():
        for w in ws:
            if comp_of[v] != comp_of[w]:
                succ[comp_of[v]].add(comp_of[w])
    best: dict[int, tuple[int, list[int]]] = {}
    # Tarjan emits components in reverse topological order: successors come first
    for i in range(len(comps)):
        tail = max((best[j] for j in succ[i]), key=lambda t: t[0], default=(0, []))
        best[i] = (tail[0] + 1, [i] + tail[1])
    if not best:
        return 0, []
    d, chain = max(best.values(), key=lambda t: t[0])
    return d, [comps[i][0] if len(comps[i]) == 1 else "{" + ", ".join(comps[i]) + "}" for i in chain]


def reachable(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """module -> every module it imports, directly or transitively."""
    out: dict[str, set[str]] = {}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo += graph.get(n, ())
        out[start] = seen
    return out


# ---- figures 1-4 ---------------------------------------------------------------------------------

def sizes(tree: Tree) -> dict:
    out = {}
    for pkg in ("tgw.broker", "tgw.workers", "tgw.shm", "tgw.client", "tgw.bench"):
        folder = tree.folder(pkg)
        rels = py_files(tree.root, folder)
        if pkg == "tgw.bench":
            rels = [r for r in rels if not r.startswith(os.path.join(folder, "testing") + os.sep)]
        main = [r for r in rels if not is_proto(r)]
        proto = [r for r in rels if is_proto(r)]
        row = {"modules": len(main), "lines": sum(line_count(tree.root, r) for r in main)}
        if proto:
            row["generated_modules"], row["generated_lines"] = len(proto), sum(line_count(tree.root, r) for r in proto)
        out[folder] = row
    return out


def line_count(root: str, rel: str) -> int:
    with open(os.path.join(root, rel), encoding="utf-8") as f:
        return len(f.read().splitlines())


def imports_figure(tree: Tree) -> dict:
    graph = import_graph(tree)
    comps = sccs(graph)
    circles = [c for c in comps if len(c) > 1]
    depth, chain = depth_and_chain(graph, comps)
    grpc_http = sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs
                       if is_face(a, "grpc") and is_face(b, "http") and not is_face(b, "grpc"))
    return {"modules": len(graph), "edges": sum(len(v) for v in graph.values()), "circles": len(circles),
            "circle_list": circles, "depth": depth, "deepest_chain": chain,
            "grpc_imports_http": len(grpc_http), "grpc_imports_http_list": grpc_http}


def is_face(modname: str, face: str) -> bool:
    parts = modname.split(".")[2:]
    return "proto" not in parts and any(p.startswith(face) for p in parts)


def find_class(tree: Tree, name: str, pkg: str = "tgw.broker") -> tuple[Module, ast.ClassDef] | None:
    for m in tree.in_package([pkg]):
        for node in m.tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return m, node
    return None


def docstring_ids(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.add(id(body[0].value))
    return out


def names_identifier(m: Module, ident: str) -> list[int]:
    """Lines where `ident` is an identifier in m's code (names, attributes, imports, string annotations)."""
    lines = []
    annotations: list[ast.AST] = []
    for node in ast.walk(m.tree):
        if isinstance(node, ast.Name) and node.id == ident:
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == ident:
            lines.append(node.lineno)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name.split(".")[-1] == ident or a.asname == ident for a in node.names):
                lines.append(node.lineno)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            annotations += [a.annotation for a in args.posonlyargs + args.args + args.kwonlyargs
                            + [args.vararg, args.kwarg] if a is not None and a.annotation is not None]
            if node.returns is not None:
                annotations.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
    for ann in annotations:
        for sub in ast.walk(ann):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                try:
                    parsed = ast.parse(sub.value, mode="eval")
                except SyntaxError:
                    continue
                if any(isinstance(n, ast.Name) and n.id == ident for n in ast.walk(parsed)):
                    lines.append(sub.lineno)
    return sorted(set(lines))


def broker_naming(tree: Tree) -> dict:
    found = find_class(tree, "Broker")
    if found is None:
        return {"defined_in": None, "modules": 0, "module_list": []}
    home = found[0].name
    hits = {m.name: names_identifier(m, "Broker") for m in tree.in_package(PRODUCT) if m.name != home}
    hits = {k: v for k, v in hits.items() if v}
    return {"defined_in": home, "modules": len(hits), "module_list": sorted(hits), "lines": hits}


def assembly_files(tree: Tree) -> list[str]:
    broker = tree.folder("tgw.broker")
    core = os.path.join(broker, "core")
    if os.path.isdir(os.path.join(tree.root, core)):
        return py_files(tree.root, core)
    return [os.path.join(broker, f) for f in ASSEMBLY_BEFORE if os.path.exists(os.path.join(tree.root, broker, f))]


def late_binding(tree: Tree) -> dict:
    per_file = {}
    for rel in assembly_files(tree):
        t = ast.parse(open(os.path.join(tree.root, rel), encoding="utf-8").read(), rel)
        lambdas = [n.lineno for n in ast.walk(t) if isinstance(n, ast.Lambda)]
        guards = [n.lineno for n in ast.walk(t) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                  and n.func.id == "getattr" and len(n.args) == 3]
        per_file[rel] = {"lambdas": len(lambdas), "getattr_guards": len(guards), "lambda_lines": lambdas,
                         "getattr_lines": guards}
    return {"assembly_files": sorted(per_file), "lambdas": sum(v["lambdas"] for v in per_file.values()),
            "getattr_guards": sum(v["getattr_guards"] for v in per_file.values()), "per_file": per_file}


# ---- figure 5: the config's path -----------------------------------------------------------------

class Func:
    """A function, method or lambda of broker/ that the flow analysis may visit."""

    def __init__(self, key: str, mod: Module, node, cls: "Cls | None", parent: "Func | None"):
        self.key, self.mod, self.node, self.cls, self.parent = key, mod, node, cls, parent
        a = node.args
        self.params = [p.arg for p in a.posonlyargs + a.args]
        self.kwonly = [p.arg for p in a.kwonlyargs]
        self.vararg, self.kwarg = a.vararg is not None, a.kwarg is not None
        self.annotations = {p.arg: p.annotation for p in a.posonlyargs + a.args + a.kwonlyargs if p.annotation}
        self.is_method = cls is not None and parent is None and not any(
            isinstance(d, ast.Name) and d.id == "staticmethod" for d in getattr(node, "decorator_list", []))
        self.nested: list[Func] = []

    @property
    def body(self) -> list:
        return self.node.body if isinstance(self.node.body, list) else [self.node.body]


class Cls:
    def __init__(self, mod: Module, node: ast.ClassDef):
        self.mod, self.node, self.name = mod, node, node.name
        self.key = f"{mod.name}:{node.name}"
        self.methods: dict[str, Func] = {}
        self.fields: list[str] = [s.target.id for s in node.body
                                  if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
        self.defaults = {s.target.id: s.value for s in node.body
                         if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value is not None}
        self.is_record = any((isinstance(d, ast.Name) and d.id == "dataclass") or
                             (isinstance(d, ast.Call) and getattr(d.func, "id", getattr(d.func, "attr", "")) == "dataclass")
                             or (isinstance(d, ast.Attribute) and d.attr == "dataclass") for d in node.decorator_list)
        self.bases: list[Cls] = []
        self.attr_types: dict[str, Cls] = {}


def own_scope(nodes) -> list[ast.AST]:
    """Every node in `nodes` and under them, but not inside nested functions, lambdas and classes
    (those nodes themselves are in: a lambda's owner is found by it)."""
    out, todo = [], list(nodes)
    while todo:
        n = todo.pop()
        out.append(n)
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo += ast.iter_child_nodes(n)
    return out


class Flow:
    """The static config flow of figure 5 over broker/ (without generated stubs)."""

    def __init__(self, tree: Tree):
        self.tree = tree
        self.graph_reach = reachable(import_graph(tree))
        self.mods = [m for m in tree.in_package(["tgw.broker"]) if not is_proto(m.rel)]
        self.funcs: dict[str, Func] = {}
        self.classes: dict[str, Cls] = {}
        self.mod_funcs: dict[str, dict[str, Func]] = defaultdict(dict)
        self.mod_classes: dict[str, dict[str, Cls]] = defaultdict(dict)
        self.by_method: dict[str, list[Func]] = defaultdict(list)
        self.bindings: dict[str, list] = defaultdict(list)       # name -> callables bound to it (callbacks)
        self.record_bindings: dict[tuple, list] = defaultdict(list)   # (record class key, field) -> callables
        self.lambdas: dict[int, Func] = {}
        for m in self.mods:
            self._index(m)
        for c in self.classes.values():
            c.bases = [b for b in (self.resolve_class(c.mod, base, None) for base in c.node.bases) if b]
        for f in list(self.funcs.values()):
            self._infer_types(f)
        for m in self.mods:
            self._collect_bindings(m)
        self.config_cls = self._find_config()
        self.sections = {f for f in self.config_cls.fields if not f.startswith("_")} if self.config_cls else set()

    # ---- indexing ----

    def _index(self, m: Module) -> None:
        def visit(body, cls: Cls | None, parent: Func | None, prefix: str):
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    f = Func(f"{m.name}:{prefix}{node.name}", m, node, cls, parent)
                    self.funcs[f.key] = f
                    if parent is not None:
                        parent.nested.append(f)
                    elif cls is not None:
                        cls.methods[node.name] = f
                        self.by_method[node.name].append(f)
                    else:
                        self.mod_funcs[m.name][node.name] = f
                    visit(node.body, None, f, f"{prefix}{node.name}.")
                elif isinstance(node, ast.ClassDef) and parent is None and cls is None:
                    c = Cls(m, node)
                    self.classes[c.key] = c
                    self.mod_classes[m.name][node.name] = c
                    visit(node.body, c, None, f"{node.name}.")
                elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                    for field in ("body", "orelse", "finalbody", "handlers"):
                        for s in getattr(node, field, []):
                            visit(s.body if isinstance(s, ast.ExceptHandler) else [s], cls, parent, prefix)
        visit(m.tree.body, None, None, "")
        # every lambda is a function of its own; its parent: the innermost function it is written in
        owner_of: dict[int, Func] = {}
        for f in [f for f in self.funcs.values() if f.mod is m]:
            for n in own_scope(f.node.body):
                owner_of[id(n)] = f
        for node in ast.walk(m.tree):   # breadth first: a lambda before the lambdas inside it
            if isinstance(node, ast.Lambda):
                parent = owner_of.get(id(node))
                f = Func(f"{m.name}:<lambda@{node.lineno}:{node.col_offset}>", m, node, None, parent)
                self.funcs[f.key] = f
                self.lambdas[id(node)] = f
                if parent is not None:
                    parent.nested.append(f)
                for n in own_scope([node.body]):
                    owner_of[id(n)] = f

    def _find_config(self) -> Cls | None:
        for c in self.classes.values():
            if c.name == "Config" and c.fields:
                return c
        return None

    # ---- name resolution ----

    def lookup(self, m: Module, name: str, scope: Func | None):
        """What `name` means in module m (inside scope): a Func, a Cls, ("module", name) or None."""
        f = scope
        while f is not None:
            for g in f.nested:
                if not isinstance(g.node, ast.Lambda) and g.node.name == name:
                    return g
            f = f.parent
        return self.lookup_global(m.name, name, set())

    def lookup_global(self, modname: str, name: str, seen: set):
        if (modname, name) in seen:
            return None
        seen.add((modname, name))
        if name in self.mod_funcs.get(modname, {}):
            return self.mod_funcs[modname][name]
        if name in self.mod_classes.get(modname, {}):
            return self.mod_classes[modname][name]
        m = self.tree.modules.get(modname)
        if m is None:
            return None
        for node in ast.walk(m.tree):
            if isinstance(node, ast.ImportFrom):
                src = self.tree.absolute(m, node.level, node.module)
                for a in node.names:
                    if (a.asname or a.name) == name:
                        if f"{src}.{a.name}" in self.tree.modules:
                            return ("module", f"{src}.{a.name}")
                        return self.lookup_global(src, a.name, seen)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname == name and a.name in self.tree.modules:
                        return ("module", a.name)
        return None

    def resolve_class(self, m: Module, expr, scope: Func | None) -> Cls | None:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            try:
                expr = ast.parse(expr.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(expr, ast.BinOp):   # X | None
            return self.resolve_class(m, expr.left, scope) or self.resolve_class(m, expr.right, scope)
        if isinstance(expr, ast.Subscript):   # Optional[X]
            return self.resolve_class(m, expr.slice, scope)
        got = None
        if isinstance(expr, ast.Name):
            got = self.lookup(m, expr.id, scope)
        elif isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            mod = self.lookup(m, expr.value.id, scope)
            if isinstance(mod, tuple):
                got = self.lookup_global(mod[1], expr.attr, set())
        return got if isinstance(got, Cls) else None

    def method(self, cls: Cls, name: str, seen=None) -> Func | None:
        seen = seen or set()
        if cls.key in seen:
            return None
        seen.add(cls.key)
        if name in cls.methods:
            return cls.methods[name]
        for b in cls.bases:
            got = self.method(b, name, seen)
            if got:
                return got
        return None

    def _infer_types(self, f: Func) -> None:
        """self.x's class, where a method assigns it a Class(...) or an annotated parameter."""
        if f.cls is None or isinstance(f.node, ast.Lambda):
            return
        ptypes = {p: self.resolve_class(f.mod, ann, f) for p, ann in f.annotations.items()}
        for n in own_scope(f.node.body):
            if isinstance(n, (ast.Assign, ast.AnnAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t, v in pairs(targets, n.value):
                    if is_self_attr(t):
                        c = None
                        if isinstance(v, ast.Name):
                            c = ptypes.get(v.id)
                        elif isinstance(v, ast.Call):
                            c = self.resolve_class(f.mod, v.func, f)
                        if c is not None:
                            f.cls.attr_types.setdefault(t.attr, c)

    def local_types(self, f: Func) -> dict[str, Cls]:
        out = {p: c for p, c in ((p, self.resolve_class(f.mod, a, f)) for p, a in f.annotations.items()) if c}
        for n in own_scope(f.body):
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call):
                c = self.resolve_class(f.mod, n.value.func, f)
                for t in n.targets:
                    if isinstance(t, ast.Name) and c is not None:
                        out[t.id] = c
        return out

    def callable_ref(self, m: Module, expr, scope: Func | None) -> list[tuple[Func, bool]]:
        """The functions an expression used as a value refers to: (func, bound: skip its self)."""
        if isinstance(expr, ast.Lambda):
            return [(self.lambdas[id(expr)], False)] if id(expr) in self.lambdas else []
        if isinstance(expr, ast.Name):
            got = self.lookup(m, expr.id, scope)
            return [(got, False)] if isinstance(got, Func) else []
        if isinstance(expr, ast.Attribute):
            if is_self_attr(expr) and scope is not None:
                cls = owning_class(scope)
                got = self.method(cls, expr.attr) if cls else None
                return [(got, True)] if got else []
            cands = self.by_method.get(expr.attr, [])
            if len(cands) == 1:
                return [(cands[0], True)]
        return []

    def _collect_bindings(self, m: Module) -> None:
        scope_of = {}
        for f in self.funcs.values():
            if f.mod is m:
                for n in own_scope(f.body):
                    scope_of[id(n)] = f
        for node in ast.walk(m.tree):
            scope = scope_of.get(id(node))
            if isinstance(node, ast.Call):
                rec = self.resolve_class(m, node.func, scope)
                for kw in node.keywords:
                    if kw.arg is None:
                        continue
                    refs = self.callable_ref(m, kw.value, scope)
                    self.bindings[kw.arg] += refs
                    if rec is not None and rec.is_record:
                        self.record_bindings[(rec.key, kw.arg)] += refs
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Attribute):
                        self.bindings[t.attr] += self.callable_ref(m, node.value, scope)
        for c in self.classes.values():
            if c.mod is m and c.is_record:
                for name, default in c.defaults.items():
                    self.record_bindings[(c.key, name)] += self.callable_ref(m, default, None)

    # ---- the analysis ----

    def callees(self, f: Func, call: ast.Call, types: dict[str, Cls]) -> list[tuple[object, bool]]:
        """(Func or record Cls, bound) for a call in f; [] when unresolved."""
        fn, m = call.func, f.mod
        if isinstance(fn, ast.Name):
            got = self.lookup(m, fn.id, f)
            if isinstance(got, Func):
                return [(got, False)]
            if isinstance(got, Cls):
                return self.construct(got)
            return []
        if not isinstance(fn, ast.Attribute):
            return []
        base = fn.value
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
            cls = owning_class(f)
            for b in (cls.bases if cls else []):
                got = self.method(b, fn.attr)
                if got:
                    return [(got, True)]
            return []
        if isinstance(base, ast.Name):
            if base.id == "self" and owning_class(f):
                got = self.method(owning_class(f), fn.attr)
                if got:
                    return [(got, True)]
                return self.by_binding(fn.attr)
            if base.id in types:
                return self.on_class(types[base.id], fn.attr)
            ref = self.lookup(m, base.id, f)
            if isinstance(ref, tuple):   # module.func
                got = self.lookup_global(ref[1], fn.attr, set())
                if isinstance(got, Func):
                    return [(got, False)]
                if isinstance(got, Cls):
                    return self.construct(got)
                return []
            if isinstance(ref, Cls):     # Class.method / Class.classmethod
                got = self.method(ref, fn.attr)
                return [(got, True)] if got else []
        if is_self_attr(base) and owning_class(f) and base.attr in owning_class(f).attr_types:
            return self.on_class(owning_class(f).attr_types[base.attr], fn.attr)
        cands = self.by_method.get(fn.attr, [])
        if len(cands) == 1:
            return [(cands[0], True)]
        if not cands:
            return self.by_binding(fn.attr)
        return []

    def on_class(self, cls: Cls, name: str) -> list:
        got = self.method(cls, name)
        if got:
            return [(got, True)]
        if cls.is_record and name in cls.fields:
            return unique(self.record_bindings.get((cls.key, name), []))
        return []

    def by_binding(self, name: str) -> list:
        if self.by_method.get(name):
            return []
        return unique(self.bindings.get(name, []))

    def construct(self, cls: Cls) -> list:
        init = self.method(cls, "__init__")
        if init is not None:
            return [(init, True)]
        if cls.is_record:
            return [(cls, False)]
        return []

    def run(self, entry: Func, param: str) -> dict:
        whole_params: dict[str, set[str]] = defaultdict(set)      # func key -> params holding the Config
        sect_params: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
        closure: dict[str, tuple[set, dict]] = {}                 # nested func key -> names it inherits
        whole_attrs: dict[str, set[str]] = defaultdict(set)       # class key -> attrs holding the Config
        sect_attrs: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
        moves: set[tuple[str, str, str]] = set()                  # (caller, callee, "whole" | section)
        unresolved: set[tuple[str, int, str]] = set()
        whole_params[entry.key].add(param)
        todo = [entry]
        active: set[str] = {entry.key}

        def enqueue(g: Func) -> None:
            active.add(g.key)
            todo.append(g)

        while todo:
            f = todo.pop()
            cls = owning_class(f)
            whole = set(whole_params[f.key])
            sect: dict[str, set] = defaultdict(set, {k: set(v) for k, v in sect_params[f.key].items()})
            if f.key in closure:
                whole |= closure[f.key][0]
                for k, v in closure[f.key][1].items():
                    sect[k] |= v
            cw = whole_attrs[cls.key] if cls else set()
            cs = sect_attrs[cls.key] if cls else {}
            returns_config = self.returns_config

            def is_whole(e) -> bool:
                if isinstance(e, ast.Await):
                    e = e.value
                if isinstance(e, ast.Name):
                    return e.id in whole
                if is_self_attr(e):
                    return e.attr in cw
                if isinstance(e, ast.Call):
                    return any(isinstance(g, Func) and returns_config(g) for g, _ in self.callees(f, e, {}))
                if isinstance(e, ast.IfExp):
                    return is_whole(e.body) or is_whole(e.orelse)
                if isinstance(e, ast.BoolOp):
                    return any(is_whole(v) for v in e.values)
                return False

            def section_of(e) -> set:
                if isinstance(e, ast.Name):
                    return set(sect.get(e.id, ()))
                if is_self_attr(e) and e.attr in cs:
                    return set(cs[e.attr])
                if isinstance(e, ast.Attribute) and e.attr in self.sections and is_whole(e.value):
                    return {e.attr}
                return set()

            nodes = own_scope(f.body) if not isinstance(f.node, ast.Lambda) else own_scope([f.node.body])
            assigns = [n for n in nodes if isinstance(n, (ast.Assign, ast.AnnAssign))]
            changed_cls = False
            for _ in range(5):   # flow-insensitive: to a fixed point
                grew = False
                for n in assigns:
                    if n.value is None:
                        continue
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                    for t, v in pairs(targets, n.value):
                        w, s = is_whole(v), section_of(v)
                        if isinstance(t, ast.Name):
                            if w and t.id not in whole:
                                whole.add(t.id)
                                grew = True
                            if s - sect[t.id]:
                                sect[t.id] |= s
                                grew = True
                        elif is_self_attr(t) and cls is not None:
                            if w and t.attr not in cw:
                                cw.add(t.attr)
                                grew = changed_cls = True
                            if s and s - cs[t.attr]:
                                cs[t.attr] |= s
                                grew = changed_cls = True
                            # a name put where the Config is held becomes the Config
                            if t.attr in cw and isinstance(v, ast.Name) and v.id not in whole:
                                whole.add(v.id)
                                grew = True
                if not grew:
                    break
            if changed_cls and cls is not None:
                for g in cls.methods.values():
                    if g is not f:
                        enqueue(g)
            types = self.local_types(f)
            for call in (n for n in nodes if isinstance(n, ast.Call)):
                passed = [(i, None, a) for i, a in enumerate(call.args) if not isinstance(a, ast.Starred)]
                passed += [(None, kw.arg, kw.value) for kw in call.keywords if kw.arg is not None]
                tainted = [(i, k, "whole" if is_whole(a) else None, section_of(a)) for i, k, a in passed]
                tainted = [t for t in tainted if t[2] or t[3]]
                if not tainted:
                    continue
                targets = self.callees(f, call, types)
                if not targets:
                    if any(t[2] for t in tainted) and ast.unparse(call.func) not in BUILTINS:
                        unresolved.add((f.key, call.lineno, ast.unparse(call.func)))
                    continue
                for g, bound in targets:
                    if isinstance(g, Cls):   # a record: its fields hold what they are given
                        for i, k, w, s in tainted:
                            field = k if k else (g.fields[i] if i < len(g.fields) else None)
                            kind = "whole" if w else None
                            if kind:
                                moves.add((f.key, g.key, "whole"))
                            for sec in s:
                                moves.add((f.key, g.key, sec))
                            if field and w:
                                whole_attrs[g.key].add(field)
                            for sec in s:
                                if field:
                                    sect_attrs[g.key][field].add(sec)
                        continue
                    params = g.params[1:] if bound and g.params and not isinstance(g.node, ast.Lambda) else g.params
                    for i, k, w, s in tainted:
                        p = k if k in params + g.kwonly else (params[i] if i is not None and i < len(params) else None)
                        if w:
                            moves.add((f.key, g.key, "whole"))
                            if p and p not in whole_params[g.key]:
                                whole_params[g.key].add(p)
                                enqueue(g)
                            elif g.key not in active:
                                enqueue(g)
                        for sec in s:
                            moves.add((f.key, g.key, sec))
                            if p and sec not in sect_params[g.key][p]:
                                sect_params[g.key][p].add(sec)
                                enqueue(g)
            # nested functions and lambdas see the names they close over
            for g in f.nested:
                a = g.node.args
                own = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}
                inh_w = whole - own
                inh_s = {k: v for k, v in sect.items() if k not in own and v}
                old = closure.get(g.key, (set(), {}))
                if inh_w - old[0] or any(v - old[1].get(k, set()) for k, v in inh_s.items()):
                    closure[g.key] = (old[0] | inh_w, {k: old[1].get(k, set()) | inh_s.get(k, set())
                                                        for k in set(old[1]) | set(inh_s)})
                    enqueue(g)
        return self.summary(entry, moves, unresolved)

    def returns_config(self, g: Func) -> bool:
        r = getattr(g.node, "returns", None)
        if r is None:
            return False
        if isinstance(r, ast.Constant) and isinstance(r.value, str):
            return r.value == "Config"
        return isinstance(r, ast.Name) and r.id == "Config"

    def file_of(self, key: str) -> str:
        f = self.funcs.get(key)
        return f.mod.rel if f else self.classes[key].mod.rel

    def mod_of(self, key: str) -> str:
        f = self.funcs.get(key)
        return f.mod.name if f else self.classes[key].mod.name

    def summary(self, entry: Func, moves, unresolved) -> dict:
        def block(kind_pred, include_entry: bool) -> dict:
            mv = sorted({(a, b) for a, b, k in moves if kind_pred(k)})
            stays = {b for _, b in mv} | ({entry.key} if include_entry else set())
            climbs = [(a, b) for a, b in mv if self.file_of(a) != self.file_of(b)
                      and self.mod_of(a) in self.graph_reach.get(self.mod_of(b), ())]
            return {"stays": len(stays), "files": len({self.file_of(s) for s in stays}), "moves": len(mv),
                    "climbs": len(climbs), "stay_list": sorted(stays),
                    "file_list": sorted({self.file_of(s) for s in stays}),
                    "climb_list": [f"{a} -> {b}" for a, b in climbs]}
        whole = block(lambda k: k == "whole", True)
        section = block(lambda k: k != "whole", False)
        per_section = defaultdict(set)
        for _, b, k in moves:
            if k != "whole":
                per_section[k].add(b)
        section["per_section"] = {k: len(v) for k, v in sorted(per_section.items())}
        return {"entry": entry.key, "whole_config": whole, "a_section": section,
                "unresolved_whole": sorted(f"{a}:{line} {what}(...)" for a, line, what in unresolved)}


def pairs(targets, value):
    """(target, value) pairs of an assignment, tuples taken element by element."""
    out = []
    for t in targets:
        if isinstance(t, ast.Tuple) and isinstance(value, ast.Tuple) and len(t.elts) == len(value.elts):
            out += list(zip(t.elts, value.elts))
        else:
            out.append((t, value))
    return out


def is_self_attr(e) -> bool:
    return isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self"


def owning_class(f: Func | None) -> Cls | None:
    while f is not None:
        if f.cls is not None:
            return f.cls
        f = f.parent
    return None


def unique(refs: list) -> list:
    seen, out = set(), []
    for g, bound in refs:
        if g.key not in seen:
            seen.add(g.key)
            out.append((g, bound))
    return out


def find_function(tree: Tree, name: str, pkg: str = "tgw.broker") -> tuple[Module, ast.FunctionDef] | None:
    for m in tree.in_package([pkg]):
        for node in m.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return m, node
    return None


def config_flow(tree: Tree) -> dict:
    found = find_function(tree, "run_broker")
    if found is None:
        return {"entry": None}
    flow = Flow(tree)
    m, node = found
    entry = flow.funcs[f"{m.name}:run_broker"]
    param = next((p for p, a in entry.annotations.items() if "Config" in ast.unparse(a)), entry.params[0])
    return flow.run(entry, param)


# ---- figures 7-9 ---------------------------------------------------------------------------------

def bench_figure(tree: Tree) -> dict:
    folder = tree.folder("tgw.bench")
    rels = [r for r in py_files(tree.root, folder) if not r.startswith(os.path.join(folder, "testing") + os.sep)]
    mains = []
    for rel in rels:
        t = ast.parse(open(os.path.join(tree.root, rel), encoding="utf-8").read(), rel)
        if any(isinstance(n, ast.If) and "__name__" in ast.unparse(n.test) and "__main__" in ast.unparse(n.test)
               for n in t.body):
            mains.append(rel)
    scripts = {}
    path = os.path.join(tree.root, "pyproject.toml")
    if os.path.exists(path):
        with open(path, "rb") as f:
            scripts = tomllib.load(f).get("project", {}).get("scripts", {})
    bench_scripts = {k: v for k, v in scripts.items() if v.split(":")[0].startswith("tgw.bench")}
    return {"modules": len(rels), "console_scripts": len(bench_scripts), "console_script_list": bench_scripts,
            "main_modules": len(mains), "main_module_list": mains,
            "entry_points": len(bench_scripts) + len(mains)}


def bench_scenarios(tree: Tree, bench_scripts: dict) -> dict:
    """The names each bench console script accepts as its first word (its argparse subparsers)."""
    out = {}
    for name, target in bench_scripts.items():
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--subcommands-of", target, name],
                           capture_output=True, text=True, timeout=120, cwd=tree.root)
        try:
            out[name] = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            out[name] = {"error": (r.stderr or r.stdout)[-500:]}
    return out


def subcommands_of(target: str, prog: str) -> None:
    """Child: run the console script `target` with --help, catch its parser as it parses, print its subcommands."""
    import importlib

    class Caught(BaseException):   # not an Exception: a main that catches those must not swallow it
        pass

    def catch(self, args=None, namespace=None):
        raise Caught(self)
    argparse.ArgumentParser.parse_known_args = catch
    modname, _, func = target.partition(":")
    main = getattr(importlib.import_module(modname), func or "main")
    sys.argv = [prog, "--help"]
    try:
        main()
    except Caught as caught:
        parser = caught.args[0]
    except SystemExit:
        print(json.dumps({"names": [], "scenarios": 0}))
        return
    names: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            names += list(action.choices)
    distinct = {id(p) for a in parser._actions if isinstance(a, argparse._SubParsersAction) for p in a.choices.values()}
    print(json.dumps({"names": names, "scenarios": len(names), "distinct_parsers": len(distinct)}))


def test_imports(tree: Tree, tests_dir: str = "tests") -> dict:
    scenarios_pkg = os.path.isdir(os.path.join(tree.root, tree.folder("tgw.bench"), "scenarios"))
    importing, scenario, in_strings = {}, {}, []
    for rel in py_files(tree.root, tests_dir):
        src = open(os.path.join(tree.root, rel), encoding="utf-8").read()
        t = ast.parse(src, rel)
        mods = set()
        for n in ast.walk(t):
            if isinstance(n, ast.Import):
                mods |= {a.name for a in n.names if a.name == "tgw.bench" or a.name.startswith("tgw.bench.")}
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                if n.module == "tgw":
                    mods |= {f"tgw.{a.name}" for a in n.names if a.name == "bench"}
                elif n.module == "tgw.bench":
                    mods |= {f"tgw.bench.{a.name}" if f"tgw.bench.{a.name}" in tree.modules else "tgw.bench"
                             for a in n.names}
                elif n.module.startswith("tgw.bench."):
                    mods.add(n.module)
        if mods:
            importing[rel] = sorted(mods)
            if scenarios_pkg:
                sc = [x for x in mods if x.startswith("tgw.bench.scenarios.") or x == "tgw.bench.scenarios"]
            else:
                sc = [x for x in mods if x not in ("tgw.bench", "tgw.bench.cli")]
            if sc:
                scenario[rel] = sorted(sc)
        docs = docstring_ids(t)
        if not mods and any(isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
                            and re.search(r"\btgw\.bench\b", n.value) for n in ast.walk(t)):
            in_strings.append(rel)
    return {"importing_bench": len(importing), "importing_bench_list": importing,
            "importing_a_scenario": len(scenario), "importing_a_scenario_list": scenario,
            "scenario_rule": "tgw.bench.scenarios.*" if scenarios_pkg else "any tgw.bench module but tgw.bench.cli",
            "naming_bench_in_strings_only": in_strings}


def handle_writers(tree: Tree, cls_name: str = "WorkerHandle") -> dict:
    found = find_class(tree, cls_name)
    if found is None:
        return {"class": None}
    home, cnode = found
    fields = [s.target.id for s in cnode.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    for n in ast.walk(cnode):
        if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if is_self_attr(e) and e.attr not in fields:
                        fields.append(e.attr)
    fset = set(fields)
    names = handle_names(tree, cls_name)
    writers: dict[str, dict[str, list[int]]] = {f: defaultdict(list) for f in fields}
    others: dict[str, set[str]] = defaultdict(set)   # writes of a field name on other receivers: not counted
    for m in tree.in_package(PRODUCT):
        # the class each node sits in, for the `self` rule
        class_of: dict[int, str] = {}
        for c in ast.walk(m.tree):
            if isinstance(c, ast.ClassDef):
                for n in ast.walk(c):
                    class_of[id(n)] = c.name   # inner classes overwrite: walked later
        for n in ast.walk(m.tree):
            for target, line in written(n):
                base = target
                while isinstance(base, ast.Subscript):
                    base = base.value
                if not isinstance(base, ast.Attribute) or base.attr not in fset:
                    continue
                recv = base.value
                if isinstance(recv, ast.Name) and recv.id == "self":
                    if class_of.get(id(n)) != cls_name or m is not home:
                        continue
                elif not ((isinstance(recv, ast.Name) and recv.id in names) or
                          (isinstance(recv, ast.Attribute) and recv.attr in names)):
                    others[base.attr].add(f"{m.name}:{line} {ast.unparse(recv)}")
                    continue
                writers[base.attr][m.name].append(line)
    per_field = {f: sorted(w) for f, w in writers.items()}
    several = {f: w for f, w in per_field.items() if len(w) > 1}
    return {"class": f"{home.name}:{cls_name}", "fields": len(fields), "field_list": fields,
            "writing_modules": sorted({m for w in per_field.values() for m in w}),
            "fields_with_several_writers": len(several), "several": several,
            "per_field": per_field, "lines": {f: {m: v for m, v in w.items()} for f, w in writers.items() if w},
            "handle_names": sorted(names), "not_counted_other_receivers": {f: sorted(v) for f, v in others.items()}}


def handle_names(tree: Tree, cls_name: str) -> set[str]:
    """The names the product gives a worker handle: parameters, annotated assignments and fields
    annotated with the class itself (or it | None, Optional[it], "it"), not containers of it."""
    def is_handle(ann) -> bool:
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            try:
                ann = ast.parse(ann.value, mode="eval").body
            except SyntaxError:
                return False
        if isinstance(ann, ast.Name):
            return ann.id == cls_name
        if isinstance(ann, ast.Attribute):
            return ann.attr == cls_name
        if isinstance(ann, ast.BinOp):
            return is_handle(ann.left) or is_handle(ann.right)
        if isinstance(ann, ast.Subscript) and ast.unparse(ann.value).split(".")[-1] == "Optional":
            return is_handle(ann.slice)
        return False
    out = set()
    for m in tree.in_package(PRODUCT):
        for n in ast.walk(m.tree):
            if isinstance(n, ast.arg) and n.annotation is not None and is_handle(n.annotation):
                out.add(n.arg)
            elif isinstance(n, ast.AnnAssign) and is_handle(n.annotation):
                t = n.target
                out.add(t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else "")
    out.discard("")
    return out


def written(n) -> list[tuple[ast.AST, int]]:
    """The expressions node n writes (assignment targets, deletions, a mutating call's receiver)."""
    out = []
    if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        if isinstance(n, ast.AnnAssign) and n.value is None:
            return []
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
            stack = [t]
            while stack:
                e = stack.pop()
                if isinstance(e, (ast.Tuple, ast.List)):
                    stack += e.elts
                elif isinstance(e, ast.Starred):
                    stack.append(e.value)
                else:
                    out.append((e, n.lineno))
    elif isinstance(n, ast.Delete):
        out += [(t, n.lineno) for t in n.targets]
    elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MUTATORS:
        out.append((n.func.value, n.lineno))
    return out


def static_figures(root: str = ROOT, subcommands: bool = True) -> dict:
    tree = Tree(root)
    bench = bench_figure(tree)
    if subcommands:
        bench["scenarios_by_script"] = bench_scenarios(tree, bench["console_script_list"])
        bench["scenarios"] = sum(v.get("scenarios", 0) for v in bench["scenarios_by_script"].values())
    return {"sizes": sizes(tree), "imports": imports_figure(tree), "naming_broker": broker_naming(tree),
            "assembly_late_binding": late_binding(tree), "config_path": config_flow(tree), "bench": bench,
            "tests_importing_bench": test_imports(tree), "worker_handle_writers": handle_writers(tree)}


# ---- figure 6: the traced broker -----------------------------------------------------------------

def traced_broker(config_path: str, address: str, counts_path: str) -> int:
    """Child: the broker's entry function under a profiler that counts calls per file of broker/;
    SIGUSR2 writes the counts to `counts_path` (atomically)."""
    import importlib
    import threading
    tree = Tree(ROOT)
    broker_dir = os.path.join(ROOT, tree.folder("tgw.broker")) + os.sep
    run_mod = find_function(tree, "run_broker")[0].name
    load_mod = find_function(tree, "load_config")[0].name
    counts: dict[str, int] = defaultdict(int)

    def profile(frame, event, arg):
        if event == "call":
            counts[frame.f_code.co_filename] += 1

    def dump(signum, frame):
        snap = {os.path.relpath(k, ROOT): v for k, v in list(counts.items()) if k.startswith(broker_dir)}
        tmp = counts_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(snap, f)
        os.replace(tmp, counts_path)
    signal.signal(signal.SIGUSR2, dump)
    cfg = importlib.import_module(load_mod).load_config(config_path)
    run_broker = importlib.import_module(run_mod).run_broker
    import inspect
    params = inspect.signature(run_broker).parameters
    kwargs = {k: v for k, v in (("address", address), ("config_path", config_path)) if k in params}
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        return run_broker(cfg, **kwargs)
    finally:
        sys.setprofile(None)


def crossed_files(n: int = N_REQUESTS) -> dict:
    import shutil
    import tempfile
    import urllib.request

    import numpy as np
    import yaml

    from tgw.client import Client
    from tgw.shm.segment import list_segments
    from tgw.workers import demo_models

    work = tempfile.mkdtemp(prefix="tgwh-", dir="/tmp")   # ipc paths must stay short
    proc = None
    try:
        try:
            path = demo_models.build_file(work, "mlp", "torchscript")
        except AttributeError:   # pragma: no cover - another demo_models
            path = demo_models.build_demo_models(work)["mlp"]["path"]
        io = demo_models.DEMO_MODELS["mlp"][2]
        cfg = {"model_roots": ["/"], "server": {},
               "workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 8, "output_arena_mb": 4},
               "http": {"port": 0},
               "models": [{"name": "mlp", "versions": [{"version": "1", "path": path}], "inputs": io["inputs"],
                           "outputs": io["outputs"], "max_batch_size": io.get("max_batch_size", 16)}]}
        config_path, counts_path = os.path.join(work, "config.yaml"), os.path.join(work, "counts.json")
        with open(config_path, "w") as f:
            yaml.safe_dump(cfg, f)
        address = f"ipc://{work}/s.sock"
        log = open(os.path.join(work, "broker.log"), "wb")
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--traced-broker", config_path,
                                 "--address", address, "--counts", counts_path],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"traced broker exited {proc.returncode}:\n" + open(log.name).read()[-3000:])
            try:
                with Client(address, connect_timeout=1.0) as probe:
                    if probe.health()["ready"]:
                        break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("traced broker not ready in 120 s:\n" + open(log.name).read()[-3000:])
            time.sleep(0.2)
        client = Client(address)
        http = client.status()["http"]
        url = (http if http.startswith("http") else f"http://{http}") + "/v2/models/mlp/infer"
        x = np.random.default_rng(0).standard_normal((1, *io["inputs"][0]["shape"])).astype(np.float32)
        name = io["inputs"][0]["name"]
        body = json.dumps({"inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32",
                                       "data": x.ravel().tolist()}]}).encode()

        def native():
            client.infer("mlp", {name: x}, timeout=30)

        def over_http():
            req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()

        seq = [0]

        def snapshot() -> dict:
            before = os.stat(counts_path).st_mtime_ns if os.path.exists(counts_path) else None
            seq[0] += 1
            os.kill(proc.pid, signal.SIGUSR2)
            end = time.monotonic() + 30
            while time.monotonic() < end:
                if os.path.exists(counts_path) and os.stat(counts_path).st_mtime_ns != before:
                    with open(counts_path) as f:
                        return json.load(f)
                time.sleep(0.02)
            raise TimeoutError("the traced broker did not write its counts")

        for _ in range(20):   # the first calls' one-off paths are not the request's
            native()
            over_http()
        out = {"requests": n}
        for label, send in (("native", native), ("http", over_http)):
            s0 = snapshot()
            t0 = time.monotonic()
            for _ in range(n):
                send()
            busy = time.monotonic() - t0
            s1 = snapshot()
            time.sleep(busy)
            s2 = snapshot()
            files = sorted(rel for rel in set(s1) | set(s2)
                           if (s1.get(rel, 0) - s0.get(rel, 0)) - (s2.get(rel, 0) - s1.get(rel, 0)) >= CROSSED * n)
            out[label] = {"files": len(files), "file_list": files, "window_s": round(busy, 2),
                          "calls_per_request": {rel: round((s1.get(rel, 0) - s0.get(rel, 0)) / n, 1) for rel in files}}
        client.close()
        os.kill(proc.pid, signal.SIGTERM)
        out["broker_exit"] = proc.wait(60)
        out["segments_left"] = list_segments(proc.pid)
        return out
    finally:
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)


# ---- the table -----------------------------------------------------------------------------------

def table(fig: dict) -> str:
    lines = []
    add = lines.append
    add("1. modules and lines")
    for folder, row in fig["sizes"].items():
        extra = f"  (+ {row['generated_modules']} generated, {row['generated_lines']} lines)" \
            if "generated_modules" in row else ""
        add(f"   {folder + '/':<10} {row['modules']:>4} modules {row['lines']:>7} lines{extra}")
    imp = fig["imports"]
    add(f"2. imports: {imp['modules']} product modules, {imp['edges']} edges; circles {imp['circles']}, "
        f"depth {imp['depth']}; gRPC imports of HTTP {imp['grpc_imports_http']}")
    for c in imp["circle_list"]:
        add(f"   circle: {', '.join(c)}")
    add(f"   deepest: {' -> '.join(imp['deepest_chain'])}")
    nb = fig["naming_broker"]
    add(f"3. modules naming the Broker ({nb['defined_in']}): {nb['modules']}  {', '.join(nb['module_list'])}")
    lb = fig["assembly_late_binding"]
    add(f"4. assembly ({', '.join(lb['assembly_files'])}): {lb['lambdas']} lambdas, {lb['getattr_guards']} getattr guards")
    for rel, row in lb["per_file"].items():
        add(f"   {rel}: {row['lambdas']} lambdas, {row['getattr_guards']} getattr")
    cp = fig["config_path"]
    if cp.get("entry"):
        w, s = cp["whole_config"], cp["a_section"]
        add(f"5. config from {cp['entry']}: whole Config {w['stays']} stays in {w['files']} files, "
            f"{w['climbs']} climbs ({w['moves']} moves); a section {s['stays']} stays in {s['files']} files, "
            f"{s['climbs']} climbs")
        add("   stays: " + ", ".join(w["stay_list"]))
        for c in w["climb_list"]:
            add(f"   climb: {c}")
        if cp["unresolved_whole"]:
            add(f"   unresolved calls passing the Config: {len(cp['unresolved_whole'])}")
    if "crossed" in fig:
        cr = fig["crossed"]
        for label in ("native", "http"):
            add(f"6. files one {label} request crosses: {cr[label]['files']}  ({cr['requests']} requests in "
                f"{cr[label]['window_s']} s)")
            add("   " + ", ".join(cr[label]["file_list"]))
        add(f"   broker exit {cr['broker_exit']}, segments left {len(cr['segments_left'])}")
    b = fig["bench"]
    add(f"7. bench: {b['modules']} modules; entry points {b['entry_points']} = {b['console_scripts']} console "
        f"script(s) + {b['main_modules']} __main__ modules; scenarios (tgw-bench NAME) {b.get('scenarios', '-')}")
    t = fig["tests_importing_bench"]
    add(f"8. tests importing bench: {t['importing_bench']}; importing a scenario: {t['importing_a_scenario']} "
        f"({t['scenario_rule']}); naming it only in strings: {len(t['naming_bench_in_strings_only'])}")
    h = fig["worker_handle_writers"]
    add(f"9. {h['class']}: {h['fields']} fields written from {len(h['writing_modules'])} modules; "
        f"fields with several writing modules: {h['fields_with_several_writers']}")
    for f, mods in h["several"].items():
        add(f"   {f}: {', '.join(mods)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write every figure and list to this file")
    ap.add_argument("--static", action="store_true", help="skip figure 6 (the traced broker)")
    ap.add_argument("--root", default=ROOT, help="the repository to read (default: this script's)")
    ap.add_argument("--traced-broker", metavar="CONFIG", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--counts", help=argparse.SUPPRESS)
    ap.add_argument("--subcommands-of", nargs=2, metavar=("TARGET", "PROG"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.traced_broker:
        return traced_broker(a.traced_broker, a.address, a.counts)
    if a.subcommands_of:
        subcommands_of(*a.subcommands_of)
        return 0
    t0 = time.monotonic()
    here = os.path.realpath(a.root) == os.path.realpath(ROOT)
    fig = static_figures(a.root, subcommands=here)   # the subcommands are read from the installed tgw
    if not a.static and here:
        fig["crossed"] = crossed_files()
    commit = subprocess.run(["git", "-C", a.root, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", a.root, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    header = {"command": " ".join([".venv/bin/python", "scripts/house-figures.py", *(argv if argv is not None else sys.argv[1:])]),
              "commit": commit, "dirty": dirty, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "wall_s": round(time.monotonic() - t0, 1)}
    print(table(fig))
    print(f"({header['wall_s']} s, commit {commit[:12]}{' + changes' if dirty else ''})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"header": header, **fig}, f, indent=1, sort_keys=False)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
