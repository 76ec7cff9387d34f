"""Where in the handler's (or model's) own code a failure came from, as file:line.

A traceback's innermost frame is often torch's or tgw's; the line an operator can fix is the
innermost one in the handler's file (a stage's), else the innermost outside tgw, torch and
Python's own library. A TorchScript model has no Python frames: its error's message quotes its
own traceback (the serialized code, then the original source when the file kept it), whose last
`File "...", line N` is the model's line that raised.
"""
from __future__ import annotations

import inspect
import os
import re
import sysconfig
import traceback
from typing import Any

import torch

_TGW = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NOT_THEIRS = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep,
               *(os.path.join(_TGW, part) + os.sep for part in ("workers", "shm", "broker")))


_SCRIPT_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def code_where(exc: BaseException, code_file: str = "") -> str:
    """"file:line" of the innermost frame of `exc`'s traceback in `code_file` (when given and
    found), else of the innermost frame outside tgw, torch and the standard library, else the
    last one a TorchScript error quotes; "" if none."""
    frames = traceback.extract_tb(exc.__traceback__)
    if code_file:
        mine = [f for f in frames if f.filename == code_file]
        if mine:
            return f"{mine[-1].filename}:{mine[-1].lineno}"
    theirs = [f for f in frames if not os.path.abspath(f.filename).startswith(_NOT_THEIRS)
              and not f.filename.startswith("<")]
    if theirs:
        return f"{theirs[-1].filename}:{theirs[-1].lineno}"
    message = str(exc)
    quoted = _SCRIPT_FRAME.findall(message) if "Traceback of TorchScript" in message else []
    return f"{quoted[-1][0]}:{quoted[-1][1]}" if quoted else ""


def definition_where(code: Any) -> str:
    """"file:line (Class.__call__)" where a callable object's __call__ (or a function) is defined."""
    target = getattr(type(code), "__call__", None) if not inspect.isroutine(code) else code
    try:
        target = inspect.unwrap(target)
        return f"{inspect.getsourcefile(target)}:{target.__code__.co_firstlineno} ({target.__qualname__})"
    except (TypeError, AttributeError):
        return type(code).__qualname__
