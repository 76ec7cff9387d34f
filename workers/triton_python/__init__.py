"""Triton Python-backend models (`TritonPythonModel` in a `model.py`) served unchanged as tgw
stages (docs/MIGRATING.md, "Python-backend models").

`backend_utils` is the module a model.py imports as `triton_python_backend_utils` (the name is
put in sys.modules before a handler file is imported: `install()`); `adapter.TritonStage` serves
such a class as a stage. Nothing of Triton's code is copied: the names and their behaviour follow
python_backend's documented API.
"""
from __future__ import annotations

import sys

MODULE_NAME = "triton_python_backend_utils"


def install() -> None:
    """Make `import triton_python_backend_utils` give tgw's compatibility module (once)."""
    if MODULE_NAME not in sys.modules:
        from . import backend_utils
        sys.modules[MODULE_NAME] = backend_utils


def is_triton_model(cls: type) -> bool:
    """A class a worker serves through the adapter: it has `execute` and is not callable itself."""
    return callable(getattr(cls, "execute", None)) and not any("__call__" in vars(k) for k in cls.__mro__)
