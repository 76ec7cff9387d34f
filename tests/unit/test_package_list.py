"""pyproject.toml lists every package folder: a folder left out installs fine in editable mode
(the dev venv) and is missing from a wheel or a plain `pip install .` (a fresh clone's CI)."""
from __future__ import annotations

import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_folder_with_an_init_is_a_listed_package():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        tool = tomllib.load(f)["tool"]["setuptools"]
    dirs = tool["package-dir"]
    roots = {os.path.join(ROOT, folder) for folder in dirs.values()}
    found = set()
    for package, folder in dirs.items():
        top = os.path.join(ROOT, folder)
        for here, subdirs, files in os.walk(top):
            # bench/testing is a package of its own (tgw.testing), not tgw.bench.testing
            subdirs[:] = [d for d in subdirs if d != "__pycache__" and os.path.join(here, d) not in roots]
            if "__init__.py" in files:
                rel = os.path.relpath(here, top)
                found.add(package if rel == "." else package + "." + rel.replace(os.sep, "."))
    assert sorted(found - set(tool["packages"])) == []
