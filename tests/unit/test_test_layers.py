"""The fast layers stay what their markers say: no test in tests/unit/ starts a process, and no
test in tests/inproc/ starts a broker (`-m "unit or inproc"` starts none).

Read with `ast`, never run: a unit test fails the rule when it calls subprocess.*, Popen, os.fork
(or os.system, os.spawn*, os.exec*, os.posix_spawn*), multiprocessing.*, BrokerProc or conftest's
served(), or takes a fixture that starts a broker (make_broker, shared_broker) - itself, or
through a helper function or fixture of its own file; an inproc test when it starts a broker so.
Such a test belongs in tests/process/ (conftest.py marks it `process` from its folder). Helpers
imported from other modules are not followed: they are the other modules' business.
"""
from __future__ import annotations

import ast
import glob
import os

UNIT = os.path.dirname(os.path.abspath(__file__))
INPROC = os.path.join(os.path.dirname(UNIT), "inproc")
BROKER_FIXTURES = {"make_broker", "shared_broker"}
OS_STARTERS = ("os.fork", "os.forkpty", "os.system", "os.popen", "os.spawn", "os.exec", "os.posix_spawn")


def dotted(node: ast.expr) -> str:
    """`a.b.c` for a Name or an Attribute chain on one; "" for anything else (a call's result...)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id, *reversed(parts)])


def imported_names(tree: ast.Module) -> dict[str, str]:
    """Local name -> what it names: `import multiprocessing as mp` gives mp -> multiprocessing,
    `from subprocess import run` gives run -> subprocess.run."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def starts_a_process(name: str) -> bool:
    """Whether a call of `name` (resolved through the imports) starts a process."""
    root, last = name.split(".")[0], name.rsplit(".", 1)[-1]
    return (root in ("subprocess", "multiprocessing") or name.startswith(OS_STARTERS)
            or name.startswith("asyncio.create_subprocess") or last == "Popen" or starts_a_broker(name))


def starts_a_broker(name: str) -> bool:
    return name.rsplit(".", 1)[-1] == "BrokerProc" or name == "conftest.served"


def is_fixture(fn: ast.FunctionDef) -> bool:
    return any(dotted(d.func if isinstance(d, ast.Call) else d).endswith("fixture") for d in fn.decorator_list)


def process_tests(source: str, starts=starts_a_process) -> dict[str, str]:
    """Test name -> why it starts a process (one that `starts`, given a called name, says starts
    one; a broker fixture always does), for the module-level tests in `source`."""
    tree = ast.parse(source)
    names = imported_names(tree)
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    fixtures = {name for name, fn in functions.items() if is_fixture(fn)}
    memo: dict[str, str] = {}

    def why(name: str, seen: frozenset) -> str:
        if name in memo:
            return memo[name]
        fn, reason = functions[name], ""
        args = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
        for arg in args:
            if arg in BROKER_FIXTURES:
                reason = f"takes the {arg} fixture"
            elif arg in fixtures and arg not in seen and why(arg, seen | {name}):
                reason = f"takes the fixture {arg}, which {why(arg, seen | {name})}"
            if reason:
                break
        for node in ast.walk(fn):
            if reason:
                break
            if isinstance(node, ast.Call):
                called = dotted(node.func)
                head, _, rest = called.partition(".")
                full = ".".join(filter(None, [names.get(head, head), rest]))
                if starts(full):
                    reason = f"calls {full} (line {node.lineno})"
                elif called in functions and called not in fixtures and called not in seen | {name} \
                        and why(called, seen | {name}):
                    reason = f"calls {called}, which {why(called, seen | {name})}"
        memo[name] = reason
        return reason

    return {name: why(name, frozenset()) for name in functions
            if name.startswith("test") and why(name, frozenset())}


def offenders(folder: str, starts) -> dict[str, str]:
    found = {}
    for path in sorted(glob.glob(os.path.join(folder, "test_*.py"))):
        with open(path, encoding="utf-8") as f:
            for test, reason in process_tests(f.read(), starts).items():
                found[f"tests/{os.path.basename(folder)}/{os.path.basename(path)}::{test}"] = reason
    return found


def test_no_unit_test_starts_a_process():
    found = offenders(UNIT, starts_a_process)
    assert not found, "tests in tests/unit/ that start processes (move them to tests/process/):\n" + \
        "\n".join(f"  {test}: {reason}" for test, reason in found.items())


def test_no_inproc_test_starts_a_broker():
    found = offenders(INPROC, starts_a_broker)
    assert not found, "tests in tests/inproc/ that start a broker (move them to tests/process/):\n" + \
        "\n".join(f"  {test}: {reason}" for test, reason in found.items())


SYNTHETIC = '''
import os
import subprocess
import multiprocessing as mp
from subprocess import Popen
from tgw.broker.child import BrokerProc
from tgw.broker.fleet.supervisor import Supervisor
from conftest import served
import pytest


def run_tool():
    return subprocess.run(["true"])


@pytest.fixture
def started():
    yield Popen(["true"])


def test_run(): subprocess.run(["true"])
def test_popen(): Popen(["true"]).wait()
def test_fork(): os.fork()
def test_system(): os.system("true")
def test_multiprocessing(): mp.Process(target=print).start()
def test_broker_proc(tmp_path): BrokerProc({}, str(tmp_path)).start()
def test_make_broker(make_broker): make_broker({})
def test_through_a_helper(): run_tool()
def test_through_a_fixture(started): pass
def test_served(tmp_path): next(served({}, str(tmp_path)))
def test_in_a_nested_function():
    def inner():
        subprocess.check_output(["true"])
    inner()


def test_pure(tmp_path):
    Supervisor(None, None, "ipc:///nowhere")        # an object that spawns nothing
    try:
        os.path.join("a", "b")
    except subprocess.TimeoutExpired:               # a name, not a call
        pass


def not_a_test():
    subprocess.run(["true"])
'''


def test_the_detector_sees_each_way_to_start_a_process():
    found = process_tests(SYNTHETIC)
    assert set(found) == {"test_run", "test_popen", "test_fork", "test_system", "test_multiprocessing",
                          "test_broker_proc", "test_make_broker", "test_through_a_helper",
                          "test_through_a_fixture", "test_served", "test_in_a_nested_function"}, found
    assert found["test_run"] == "calls subprocess.run (line 21)"
    assert found["test_multiprocessing"].startswith("calls multiprocessing.Process")
    assert found["test_through_a_helper"].startswith("calls run_tool, which calls subprocess.run")
    assert found["test_through_a_fixture"].startswith("takes the fixture started, which calls subprocess.Popen")
    assert found["test_make_broker"] == "takes the make_broker fixture"


def test_the_broker_rule_sees_brokers_and_only_them():
    found = process_tests(SYNTHETIC, starts_a_broker)
    assert set(found) == {"test_broker_proc", "test_make_broker", "test_served"}, found
