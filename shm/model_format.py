"""Which of the three servable formats a model file holds, told from its zip directory alone.

All three are zip archives under one top folder: a TorchScript file (`torch.jit.save`) has
`code/` and `data.pkl`; a `.pt2` archive has `archive_format` = "pt2" and holds an exported
program as `models/<name>.json` (`torch.export.save`) and/or an AOTInductor build under
`data/aotinductor/<name>/` (`aoti_compile_and_package`). No torch is needed, so the broker
checks a config (check-config, start-up, reload, `models load`) with the same function the
worker uses on the very bytes it loads.
"""
from __future__ import annotations

import json
import zipfile
from typing import IO, Optional, Union

FORMATS = ("torchscript", "export", "aoti")
FORMAT_NAMES = {"torchscript": "a TorchScript archive (torch.jit.save)",
                "export": "a torch.export program (torch.export.save)",
                "aoti": "an AOTInductor package (aoti_compile_and_package)"}
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
    try:
        with zipfile.ZipFile(f) as archive:
            names = archive.namelist()
            found = formats_in(names)
            if not _is_pt2(archive, names):   # models/ or data/aotinductor/ in some other archive
                found = {k: v for k, v in found.items() if k == "torchscript"}
    except (zipfile.BadZipFile, EOFError):
        raise ModelFormatError(f"{where} is not a zip archive, so none of {', '.join(FORMATS)}: a model file is "
                               "written by torch.jit.save, torch.export.save or aoti_compile_and_package") from None
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
