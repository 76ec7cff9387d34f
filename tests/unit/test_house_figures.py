"""scripts/house-figures.py's static figures on a tiny synthetic house in tmp_path, whose every
figure is known: a circle, a config that climbs back up through a callback, a worker handle
written from two modules, bench tests of each kind. The traced broker (figure 6) is not run here."""
from __future__ import annotations

import importlib.util
import os
import textwrap

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "house-figures.py")

# BENCH: the bench package's name, put in as the files are written, so that this file names it
# nowhere (figure 8 would count it among the tests naming bench in strings)
PYPROJECT = """
[project.scripts]
tgw-bench = "BENCH.cli:main"

[tool.setuptools]
package-dir = { "tgw.broker" = "broker", "tgw.workers" = "workers", "tgw.shm" = "shm", "tgw.client" = "client", "BENCH" = "bench" }
"""

FILES = {
    "broker/__init__.py": "",
    # a circle: a imports b at module level, b imports a inside a function
    "broker/a.py": "from tgw.broker import b\n",
    "broker/b.py": "def late():\n    from . import a\n    return a\n",
    "broker/c.py": "from .a import *\n",
    "broker/config.py": """
        '''The Broker is not named here: this is a docstring.'''
        class ServerDecl:
            port: int = 0

        class Config:
            server: ServerDecl = ServerDecl()
            workers: dict = {}
            _private: int = 0
    """,
    "broker/registry.py": """
        class Registry:
            def __init__(self, cfg):
                self.cfg = cfg

            def reload(self):
                self.on_new(self.cfg)   # a callback: the Broker's apply
    """,
    "broker/server.py": """
        from .registry import Registry

        class Broker:
            def __init__(self, cfg):
                self.registry = Registry(cfg)
                self.registry.on_new = self.apply
                self.server = cfg.server
                self.later = lambda: None

            def apply(self, cfg):
                self.port = cfg.server.port
    """,
    # a reload: a callback in a deps record, filled in by the assembly (wiring imports reload)
    "broker/reload.py": """
        from dataclasses import dataclass
        from typing import Callable

        def read():
            return None

        @dataclass
        class ReloadDeps:
            apply: Callable = lambda cfg: None

        class Reloader:
            def __init__(self, d: ReloadDeps, cfg):
                self.d, self.cfg = d, cfg

            def reload(self):
                new = read()
                self.cfg = new           # the new config becomes the config
                self.d.apply(new)
    """,
    "broker/wiring.py": """
        from .reload import ReloadDeps

        def reload_deps(b) -> ReloadDeps:
            return ReloadDeps(apply=lambda cfg: b.note(cfg.server))
    """,
    "broker/main.py": """
        from . import wiring
        from .config import Config
        from .reload import Reloader
        from .server import Broker

        def helper(server):
            return server.port

        def run_broker(cfg: Config, address=None):
            b = Broker(cfg)
            helper(cfg.server)
            Reloader(wiring.reload_deps(b), cfg)
            return getattr(b, "http", None) or 0
    """,
    "broker/pool.py": """
        from dataclasses import dataclass, field

        @dataclass
        class WorkerHandle:
            budget: int = 0
            sizes: dict = field(default_factory=dict)

            def grow(self) -> None:
                self.sizes["x"] = 1
                self.extra = []
    """,
    "broker/placement.py": """
        from .pool import WorkerHandle

        class Other:
            def __init__(self):
                self.budget = 1          # self of another class: not the handle

        def place(w: WorkerHandle, limit) -> None:
            w.budget = 3
            w.sizes.clear()
            limit.budget += 1            # not a name the handle goes by
    """,
    "broker/handshake.py": """
        from .pool import WorkerHandle

        def hello(worker: WorkerHandle) -> None:
            worker.budget = 5
    """,
    "workers/__init__.py": "",
    "shm/__init__.py": "",
    "client/__init__.py": "from .api import Client\n",
    "client/api.py": "class Client:\n    pass\n",
    "bench/__init__.py": "",
    "bench/cli.py": "def main():\n    pass\n\n\nif __name__ == '__main__':\n    main()\n",
    "bench/scen.py": "X = 1\n",
    "bench/testing/__init__.py": "# tgw.testing lives here: not bench\n",
    "tests/test_scen.py": "from BENCH import scen\n",
    "tests/test_cli.py": "def test():\n    import BENCH.cli\n",
    "tests/test_strings.py": "ARGV = ['-m', 'BENCH.cli']\n",
    "tests/test_none.py": "import os\n",
}


@pytest.fixture(scope="module")
def house():
    spec = importlib.util.spec_from_file_location("house_figures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def figures(house, tmp_path_factory):
    root = tmp_path_factory.mktemp("house")
    (root / "pyproject.toml").write_text(PYPROJECT.replace("BENCH", "tgw" + ".bench"))
    for rel, text in FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n").replace("BENCH", "tgw" + ".bench"))
    return house.static_figures(str(root), subcommands=False)


def test_sizes(figures):
    assert figures["sizes"]["broker"]["modules"] == 13
    assert figures["sizes"]["bench"] == {"modules": 3, "lines": 7}   # bench/testing/ is not bench


def test_circles_and_depth(figures):
    imp = figures["imports"]
    assert imp["circles"] == 1
    assert imp["circle_list"] == [["tgw.broker.a", "tgw.broker.b"]]
    # main -> server -> registry and main -> wiring -> reload; c -> {a, b} is two
    assert imp["depth"] == 3
    assert imp["deepest_chain"] in (["tgw.broker.main", "tgw.broker.server", "tgw.broker.registry"],
                                    ["tgw.broker.main", "tgw.broker.wiring", "tgw.broker.reload"])


def test_package_reexport_resolves_to_the_module(house, tmp_path):
    (tmp_path / "client").mkdir()
    (tmp_path / "client" / "__init__.py").write_text("from .api import Client\n")
    (tmp_path / "client" / "api.py").write_text("class Client:\n    pass\n")
    (tmp_path / "client" / "user.py").write_text("from tgw.client import Client\n")
    tree = house.Tree(str(tmp_path))
    assert house.imports_of(tree, tree.modules["tgw.client.user"]) == {"tgw.client.api"}


def test_modules_naming_the_broker(figures):
    assert figures["naming_broker"]["defined_in"] == "tgw.broker.server"
    assert figures["naming_broker"]["module_list"] == ["tgw.broker.main"]


def test_late_binding_in_assembly(figures):
    lb = figures["assembly_late_binding"]
    assert lb["assembly_files"] == ["broker/main.py", "broker/server.py", "broker/wiring.py"]
    assert (lb["lambdas"], lb["getattr_guards"]) == (2, 1)


def test_config_stays_and_climbs(figures):
    cp = figures["config_path"]
    assert cp["entry"] == "tgw.broker.main:run_broker"
    whole = cp["whole_config"]
    named = [s for s in whole["stay_list"] if "<lambda" not in s]
    assert named == ["tgw.broker.main:run_broker", "tgw.broker.registry:Registry.__init__",
                     "tgw.broker.reload:Reloader.__init__", "tgw.broker.server:Broker.__init__",
                     "tgw.broker.server:Broker.apply"]
    # the record's default and the lambda the wiring binds to the field
    lambdas = [s.split(":<")[0] for s in whole["stay_list"] if "<lambda" in s]
    assert lambdas == ["tgw.broker.reload", "tgw.broker.wiring"]
    assert (whole["stays"], whole["files"]) == (7, 5)
    # the registry hands the config back up to the server, and the reloader to the wiring: both import them
    climbs = [c.split(":<")[0] for c in whole["climb_list"]]
    assert climbs == ["tgw.broker.registry:Registry.reload -> tgw.broker.server:Broker.apply",
                      "tgw.broker.reload:Reloader.reload -> tgw.broker.wiring"]
    section = cp["a_section"]
    assert section["stay_list"] == ["tgw.broker.main:helper"]
    assert section["per_section"] == {"server": 1}


def test_bench_entry_points(figures):
    b = figures["bench"]
    assert b["modules"] == 3
    assert (b["console_scripts"], b["main_modules"], b["entry_points"]) == (1, 1, 2)


def test_tests_importing_bench(figures):
    t = figures["tests_importing_bench"]
    assert sorted(t["importing_bench_list"]) == ["tests/test_cli.py", "tests/test_scen.py"]
    assert list(t["importing_a_scenario_list"]) == ["tests/test_scen.py"]
    assert t["naming_bench_in_strings_only"] == ["tests/test_strings.py"]


def test_worker_handle_writers(figures):
    h = figures["worker_handle_writers"]
    assert h["field_list"] == ["budget", "sizes", "extra"]
    assert h["per_field"] == {"budget": ["tgw.broker.handshake", "tgw.broker.placement"],
                              "sizes": ["tgw.broker.placement", "tgw.broker.pool"],
                              "extra": ["tgw.broker.pool"]}
    assert h["fields_with_several_writers"] == 2
