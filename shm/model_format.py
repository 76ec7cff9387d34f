"""Which of the four servable formats a model file holds, told from the file without torch.

An ONNX model is one protobuf message (ModelProto), walked by `onnx_proto.py`. The other three
are zip archives under one top folder, told from their zip directory alone: a TorchScript file (`torch.jit.save`) has
`code/` and `data.pkl`; a `.pt2` archive has `archive_format` = "pt2" and holds an exported
program as `models/<name>.json` (`torch.export.save`) and/or an AOTInductor build under
`data/aotinductor/<name>/` (`aoti_compile_and_package`). No torch is needed, so the broker
checks a config (check-config, start-up, reload, `models load`) with the same function the
worker uses on the very bytes it loads.
"""
from __future__ import annotations

import json
import os
import zipfile
from typing import IO, Optional, Union

from .onnx_proto import NotOnnx, OnnxInfo, read_model

FORMATS = ("torchscript", "export", "aoti")   # the zip archives torch writes
ONNX = "onnx"
MODEL_FORMATS = (*FORMATS, ONNX)              # every format a version's file may hold
FORMAT_NAMES = {"torchscript": "a TorchScript archive (torch.jit.save)",
                "export": "a torch.export program (torch.export.save)",
                "aoti": "an AOTInductor package (aoti_compile_and_package)",
                ONNX: "an ONNX model (torch.onnx.export)"}
PT2_MODEL = "model"   # the name torch.export.save and aoti_compile_and_package give the one model


class ModelFormatError(ValueError):
    """The file is not a servable model of the format asked for; the message says what it is."""


def formats_in(names: list[str]) -> dict[str, list[str]]:
    """format -> the model names of that format the archive holds (TorchScript: [""])."""
    found: dict[str, list[str]] = {}
    for name in names:
        parts = name.split("/")
        if len(parts) >= 3 and parts[1] == "code":
            found.setdefault("torchscript", [""])
        elif len(parts) == 3 and parts[1] == "models" and parts[2].endswith(".json"):
            found.setdefault("export", []).append(parts[2][:-len(".json")])
        elif len(parts) >= 5 and parts[1:3] == ["data", "aotinductor"] and parts[3] not in found.get("aoti", []):
            found.setdefault("aoti", []).append(parts[3])
    return found


def detect(f: Union[str, IO[bytes]], declared: Optional[str] = None, where: str = "") -> str:
    """The file's format: `declared` when it holds that, else the one it holds; ModelFormatError
    (naming the file and what was found) when it is no servable model, holds a different format
    than declared, or holds two and none is declared."""
    where = where or (f if isinstance(f, str) else "model file")
    if not _is_zip(f):
        return _onnx(f, declared, where)
    try:
        with zipfile.ZipFile(f) as archive:
            names = archive.namelist()
            found = formats_in(names)
            if not _is_pt2(archive, names):   # models/ or data/aotinductor/ in some other archive
                found = {k: v for k, v in found.items() if k == "torchscript"}
    except (zipfile.BadZipFile, EOFError):
        raise ModelFormatError(f"{where} is a damaged zip archive, so none of {', '.join(FORMATS)}") from None
    if not found:
        raise ModelFormatError(f"{where}: {_what_else(names)}")
    if declared is not None:
        if declared not in found:
            raise ModelFormatError(f"{where} is declared format: {declared} but is {_listing(found)}")
        fmt = declared
    elif len(found) > 1:
        raise ModelFormatError(f"{where} holds {_listing(found)}: set the version's format: to the one to serve")
    else:
        fmt = next(iter(found))
    if fmt != "torchscript" and PT2_MODEL not in found[fmt]:
        raise ModelFormatError(f"{where}: its {fmt} models are named {found[fmt]}; tgw serves the one named "
                               f"{PT2_MODEL!r} (the name torch.export.save and aoti_compile_and_package give it)")
    return fmt


def _is_zip(f: Union[str, IO[bytes]]) -> bool:
    try:
        return zipfile.is_zipfile(f)
    finally:
        if hasattr(f, "seek"):
            f.seek(0)


def _onnx(f: Union[str, IO[bytes]], declared: Optional[str], where: str) -> str:
    """ONNX when the file is an ONNX model (and its external weights lie beside it, for a path)."""
    try:
        info = onnx_info(f)
    except NotOnnx as exc:
        if declared == ONNX or where.endswith(".onnx"):
            raise ModelFormatError(f"{where} is not an ONNX model (a ModelProto as torch.onnx.export writes "
                                   f"it): {exc}") from None
        raise ModelFormatError(f"{where} is not a zip archive, so none of {', '.join(FORMATS)}, nor an ONNX model "
                               f"({exc}): a model file is written by torch.jit.save, torch.export.save, "
                               "aoti_compile_and_package or torch.onnx.export") from None
    if declared not in (None, ONNX):
        raise ModelFormatError(f"{where} is declared format: {declared} but is {FORMAT_NAMES[ONNX]}")
    if isinstance(f, str):
        problems = external_data_problems(f, info)
        if problems:
            raise ModelFormatError(f"{where}: {'; '.join(problems)}")
    return ONNX


def onnx_info(f: Union[str, IO[bytes]]) -> OnnxInfo:
    """An ONNX file's IR version, producer, weight bytes and external data files; NotOnnx if none."""
    if isinstance(f, str):
        with open(f, "rb") as opened:
            return read_model(opened)
    try:
        return read_model(f)
    finally:
        f.seek(0)


def external_data_problems(path: str, info: OnnxInfo) -> list[str]:
    """Each external weights file of the ONNX model at `path` that is missing or lies outside
    its folder (onnxruntime reads them relative to the model's folder)."""
    folder, problems = os.path.dirname(os.path.abspath(path)), []
    for location in info.external_files:
        if os.path.isabs(location) or ".." in location.replace("\\", "/").split("/"):
            problems.append(f"its weights file {location!r} (external data) lies outside the model's folder")
        elif not os.path.isfile(os.path.join(folder, location)):
            problems.append(f"its weights lie in {location!r} (external data), which is not beside it: keep the "
                            "two files together (torch.onnx.export(..., external_data=False) writes one file)")
    return problems


def aoti_metadata(f: Union[str, IO[bytes]]) -> dict[str, str]:
    """What an AOTInductor package was compiled for: AOTI_DEVICE_KEY (cpu, cuda), AOTI_CPU_ISA, ..."""
    with zipfile.ZipFile(f) as archive:
        prefix = f"/data/aotinductor/{PT2_MODEL}/"
        meta = [n for n in archive.namelist() if prefix in n and n.endswith("wrapper_metadata.json")]
        return json.loads(archive.read(meta[0])) if meta else {}


def _is_pt2(archive: zipfile.ZipFile, names: list[str]) -> bool:
    marker = next((n for n in names if n.count("/") == 1 and n.endswith("/archive_format")), None)
    return marker is not None and archive.read(marker).strip() == b"pt2"


def _listing(found: dict[str, list[str]]) -> str:
    return " and ".join(FORMAT_NAMES[k] for k in FORMATS if k in found)


def _what_else(names: list[str]) -> str:
    if any(n.endswith("/data.pkl") for n in names):
        return ("a torch.save checkpoint (pickled tensors or a pickled module), not a servable program: export it "
                "with torch.export.save, aoti_compile_and_package or torch.jit.save (docs/MODELS.md)")
    return "a zip archive holding no TorchScript code, exported program or AOTInductor model"
