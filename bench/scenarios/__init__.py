"""tgw.bench.scenarios: one module per benchmark scenario, each reached only as `tgw-bench NAME`
(bench/cli.py). A scenario module holds

* `NAME`: its name on the command line (a dash in it is an underscore in the module's name); `HELP`: one line for `tgw-bench --help`;
* its docstring: the first paragraph is the subcommand's description, the rest its epilog
  (usage lines);
* `add_arguments(parser)`: its options on an argparse parser the cli made for it;
* `run(args) -> int`: the run, its exit status; `args.command_line` is the command as typed.

It imports the harness (tgw.bench.harness) and tgw.testing, never another scenario. Scenarios
whose question is answered and whose result file is committed are retired: their code is gone,
bench/results/RETIRED.md says what they answered, with which file, command and commit.
"""
from __future__ import annotations

import importlib
from types import ModuleType

# in the order `tgw-bench --help` lists them
NAMES = ("load", "compare", "overload", "fleet", "formats", "compress", "gpu", "generate", "generate-faces",
         "sequences", "faces", "onnx", "triton-ensemble", "torchserve", "gc-pauses")


def scenario(name: str) -> ModuleType:
    """The scenario module called `name` (one of NAMES)."""
    if name not in NAMES:
        raise LookupError(f"no scenario {name!r}; choose from {', '.join(NAMES)}")
    return importlib.import_module(f"{__name__}.{name.replace('-', '_')}")   # generate-faces: generate_faces
