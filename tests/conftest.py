"""Fixtures: tiny models, a real broker process per test module, and a leak guard.

Everything is real: broker and workers are processes, sockets are ipc:// under a short /tmp
path, rings live in /dev/shm. The leak guard fails a test that leaves a tgw segment or a
child process behind.
"""
from __future__ import annotations

import atexit
import functools
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter

import psutil
import pytest

from tgw.testing.child import BrokerProc
from tgw.client import Client, TgwError
from tgw.shm.segment import list_segments

HERE = os.path.dirname(__file__)
POLL_S = 0.01  # how often wait_until looks; a look is cheap, and the bound is what matters
sys.path.insert(0, HERE)

EXT = os.path.join(HERE, "worker_ext.py")  # the test preload: custom ops that crash or leak
BASE_MODELS = ("mlp", "embed")          # from the demo set
TEST_MODELS = ("mixed", "fails", "spin")  # from tests/models.py


def _with_fronts(n: int) -> None:
    """TGW_TEST_FRONTS=N: every broker a test starts (served, make_broker, or BrokerProc itself)
    runs N front processes (server.front_processes), so the face tests check the faces as the
    fronts serve them (tests/process/test_faces_with_fronts.py runs them so)."""
    init = BrokerProc.__init__

    @functools.wraps(init)
    def with_fronts(self, config: dict, workdir: str):
        init(self, {**config, "server": {"front_processes": n, **(config.get("server") or {})}}, workdir)   # a test's own value wins
    BrokerProc.__init__ = with_fronts


if os.environ.get("TGW_TEST_FRONTS"):
    _with_fronts(int(os.environ["TGW_TEST_FRONTS"]))


def unloaded_model(path, salt: bytes = b"") -> None:
    """A file config validation takes for a TorchScript archive (its zip directory says so) and
    no worker could load: for tests that validate configs and never load their models."""
    import zipfile
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/code/__torch__.py", b"# never loaded\n" + salt)
        archive.writestr("archive/data.pkl", b"")


@functools.cache
def placeholder_model() -> str:
    """One unloaded_model file for the session, for configs built when a test module is imported."""
    folder = tempfile.mkdtemp(prefix="tgw-placeholder-")
    atexit.register(shutil.rmtree, folder, True)
    path = os.path.join(folder, "placeholder.pt")
    unloaded_model(path)
    return path


@pytest.fixture(scope="session")
def model_files(tmp_path_factory) -> dict:
    """name -> (path, io declaration) for the demo models and the test models."""
    from models import MODELS, save
    from tgw.workers.demo_models import DEMO_MODELS, build_demo_models

    out = str(tmp_path_factory.mktemp("models"))
    demo = build_demo_models(out)
    files = {n: (demo[n]["path"], DEMO_MODELS[n][2]) for n in demo}
    for name in MODELS:
        path = os.path.join(out, f"{name}.pt")
        save(name, path)
        files[name] = (path, MODELS[name][1])
    return files


def wait_until(condition, timeout: float = 30.0, what: str = "condition"):
    """Poll `condition()` until it returns something truthy (returned); fail after `timeout` s.

    The one way tests wait: on an observable condition with a bound, never a bare sleep."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(POLL_S)


def kill_broker(b) -> None:
    """SIGKILL the broker (by its PID) and wait for its workers to follow it (PR_SET_PDEATHSIG)."""
    workers = b.worker_pids()
    b.proc.kill()
    b.proc.wait()
    for w in workers:
        try:
            psutil.Process(w).wait(30)
        except psutil.NoSuchProcess:
            pass


def readme_block(marker: str) -> str:
    """The code block right after `<!-- MARKER -->` in README.md or one of docs/*.md. The marker
    must occur exactly once over all of them (a test runs one block, so two would leave one
    untested), and be followed by a fenced code block."""
    import glob
    root = os.path.join(HERE, "..")
    tag = f"<!-- {marker} -->\n"
    found = []
    for path in [os.path.join(root, "README.md"), *sorted(glob.glob(os.path.join(root, "docs", "*.md")))]:
        with open(path) as f:
            text = f.read()
        found += [(os.path.relpath(path, root), text)] * text.count(tag)
    if len(found) != 1:
        where = ", ".join(p for p, _ in found) or "none of README.md, docs/*.md"
        raise AssertionError(f"marker <!-- {marker} --> must occur exactly once; found {len(found)} ({where})")
    path, text = found[0]
    block = text.split(tag, 1)[1]
    if not block.startswith("```"):
        raise AssertionError(f"{path}: <!-- {marker} --> is not followed by a fenced code block")
    return block.split("\n", 1)[1].split("\n```\n", 1)[0]


def in_flight(client) -> int:
    """Batches the broker has handed to workers and not yet seen completed."""
    return sum(p.get("inflight", 0) for p in client.stats()["processes"] if p["role"] == "worker")


@pytest.fixture(scope="module")
def ext_models(tmp_path_factory) -> dict:
    import worker_ext  # registers the custom ops in this process, to script the models
    out = tmp_path_factory.mktemp("ext")
    files = {}
    for name in worker_ext.MODELS:
        path = str(out / f"{name}.pt")
        worker_ext.save(name, path)
        files[name] = (path, worker_ext.MODELS[name][1])
    return files


class Load:
    """Closed-loop callers, each one request at a time, recording every outcome.

    tally: a tests/faults/tally.py Tally that counts each outcome as it comes; on_result:
    called in the caller's thread as on_result(inputs, outcome) (a result dict or a TgwError),
    e.g. to check outputs against the inputs."""

    def __init__(self, address: str, n: int, make_inputs, model: str = "mlp", timeout: float = 30.0,
                 tally=None, on_result=None):
        self.client = Client(address)
        self.results: list = []
        self.tally, self.on_result = tally, on_result
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i, make_inputs, model, timeout)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int, make_inputs, model: str, timeout: float) -> None:
        k = 0
        while not self.stop.is_set():
            inputs = make_inputs(i, k)
            try:
                outcome = self.client.infer(model, inputs, timeout=timeout)
            except TgwError as err:
                outcome = err
            self.results.append(outcome)
            if self.tally is not None:
                self.tally.add(outcome)
            if self.on_result is not None:
                self.on_result(inputs, outcome)
            k += 1

    def finish(self) -> Counter:
        """Stop, wait for every caller's last answer, and count outcomes by code ("ok" for results)."""
        self.stop.set()
        for t in self.threads:
            t.join(120)
            assert not t.is_alive(), "a caller never got its answer"
        self.client.close()
        return Counter("ok" if isinstance(r, dict) else r.code.value for r in self.results)


def model_entry(files: dict, name: str, **overrides) -> dict:
    path, io = files[name]
    entry = {"name": name, "versions": [{"version": "1", "path": path}], "inputs": io["inputs"],
             "outputs": io["outputs"], "max_batch_size": io.get("max_batch_size", 16)}
    entry.update(overrides)
    return entry


@pytest.fixture
def short_dir():
    d = tempfile.mkdtemp(prefix="tgwt-", dir="/tmp")  # ipc paths must stay under 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_broker(short_dir):
    """Factory: make_broker(config_dict) -> started BrokerProc; stopped (exit 0 checked) at teardown."""
    started: list[BrokerProc] = []

    def factory(config: dict, start: bool = True, sub: str = "") -> BrokerProc:
        d = os.path.join(short_dir, sub) if sub else short_dir
        os.makedirs(d, exist_ok=True)
        b = BrokerProc(config, d)
        started.append(b)
        return b.start() if start else b

    yield factory
    for b in started:
        if b.proc is not None and b.proc.poll() is None:
            code = b.stop()
            assert code == 0, f"broker exited {code} on SIGTERM:\n{b.output()}"


def base_config(files: dict, *names: str, workers: dict | None = None, server: dict | None = None,
                supervisor: dict | None = None, **model_overrides) -> dict:
    cfg = {"server": server or {},
           "workers": workers or {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 8,
                                  "output_arena_mb": 4},
           "models": [model_entry(files, n, **model_overrides.get(n, {})) for n in names]}
    if supervisor:
        cfg["supervisor"] = supervisor
    return cfg


def in_parallel(address: str, model: str, rows: list[bytes], name: str = "data") -> list:
    """Each row as its own caller's request (input `name`, one element), all at once: the
    outputs or the TgwError, per row."""
    out: list = [None] * len(rows)

    def call(k: int) -> None:
        with Client(address) as c:
            try:
                out[k] = c.infer(model, {name: [rows[k]]}, timeout=30)
            except TgwError as err:
                out[k] = err
    threads = [threading.Thread(target=call, args=(k,)) for k in range(len(rows))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def served(cfg: dict, d: str, http: bool = False, grpc: bool = False, **attrs):
    """A module fixture's body: a real broker on `cfg` in folder `d` (with `http`, `b.http` is its
    HTTP face's address, with `grpc` `b.grpc` its gRPC face's; `attrs` are set on it), yielded;
    then stopped, which must exit 0 and leave no segment, and `d` removed. Use as
    `yield from served(cfg, d)`."""
    b = BrokerProc(cfg, d).start()
    for key, value in attrs.items():
        setattr(b, key, value)
    if http or grpc:
        with Client(b.address) as c:
            faces = c.status()
        b.http, b.grpc = faces.get("http"), faces.get("grpc")
    yield b
    code = b.stop()
    shutil.rmtree(d, ignore_errors=True)
    assert code == 0, f"broker exited {code} on SIGTERM:\n{b.output()}"
    assert not list_segments(b.proc.pid), "segments left in /dev/shm after a clean stop"


@pytest.fixture(scope="module")
def shared_broker(model_files, tmp_path_factory):
    """One broker with two CPU workers serving every test model, shared by a test module."""
    d = tempfile.mkdtemp(prefix="tgwm-", dir="/tmp")
    cfg = base_config(model_files, *BASE_MODELS, *TEST_MODELS,
                      workers={"devices": ["cpu", "cpu"], "threads_per_worker": 1, "input_arena_mb": 8,
                               "output_arena_mb": 4},
                      server={"max_request_bytes": 4 << 20},
                      spin={"max_queue": 4, "max_batch_size": 1},
                      fails={"max_batch_size": 1})
    yield from served(cfg, d)


def _is_ours(p: psutil.Process) -> bool:
    """A live child that a test started (multiprocessing's helper processes outlive tests by design)."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE and "multiprocessing" not in " ".join(p.cmdline())
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(autouse=True)
def leak_guard(request):
    """No test may leave tgw segments of a dead creator or stray child processes behind."""
    before_children = {p.pid for p in psutil.Process().children(recursive=True)}
    before_segments = set(list_segments())  # other programs' segments are not this test's doing
    yield
    leaks: dict = {}

    def clean() -> bool:
        leaks["children"] = [p for p in psutil.Process().children(recursive=True)
                             if p.pid not in before_children and _is_ours(p)]
        leaks["segments"] = [s for s in list_segments()
                             if s not in before_segments and not psutil.pid_exists(int(s.split("_")[2]))]
        return not leaks["children"] and not leaks["segments"]

    try:
        wait_until(clean, 10, "children to exit and segments to go")
    except AssertionError:
        for p in leaks["children"]:
            p.kill()
        pytest.fail(f"leaked: children {[p.pid for p in leaks['children']]}, segments {leaks['segments']}")


def pytest_terminal_summary(terminalreporter):
    """The fault scenarios' rows (tests/faults/tally.py), as one table at the end of the run."""
    tally = sys.modules.get("tally")
    lines = tally.table() if tally is not None else []
    if lines:
        terminalreporter.section("fault scenarios: requests and their outcomes")
        for line in lines:
            terminalreporter.write_line(line)


LAYERS = ("unit", "inproc", "process", "faults", "gpu")   # tests/<layer>/: the marker of the same name


def pytest_collection_modifyitems(config, items):
    """Each test carries its layer's marker (`-m unit`, `-m "not process"`), from its folder."""
    for item in items:
        parts = os.path.relpath(str(item.fspath), HERE).split(os.sep)
        if parts[0] in LAYERS:
            item.add_marker(parts[0])
