#!/usr/bin/env python3
"""The key table of docs/CONFIGURATION.md, generated from the configuration schema.

Each key, its values (type and range) and its default come from the pydantic schema that the
broker validates with (tgw.broker.config), so the table cannot drift from it; the meaning of
each key is the table's own last column, kept by key when the table is rebuilt. A key new to
the schema gets the meaning UNDOCUMENTED until someone writes one; a key gone from the schema
loses its row.

    python scripts/config-table.py           # rewrite the table between its markers
    python scripts/config-table.py --check   # exit 1 if the committed table is not what the schema gives

tests/unit/test_docs.py runs the same comparison.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import types
import typing

from pydantic import BaseModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "CONFIGURATION.md")
START, END = "<!-- config-table:start -->", "<!-- config-table:end -->"
HEADER = "| key | values | default | meaning |\n|---|---|---|---|"
UNDOCUMENTED = "UNDOCUMENTED"

# patterns the schema uses, in words (any other is printed as it is)
PATTERNS = {
    r"^[A-Za-z0-9._-]+$": "of `A-Z a-z 0-9 . _ -`",
    r"^[0-9a-f]{64}$": "of 64 lowercase hex digits",
    r"^0?[0-7]{3}$": "of octal digits",
    r"^(cpu|cuda:\d+)$": "`cpu` or `cuda:N`",
}


def schema_config() -> type[BaseModel]:
    """The schema's top model, wherever the broker package keeps it."""
    try:
        from tgw.broker.config import Config   # the package re-exports it
        return Config
    except ImportError:
        pass
    try:
        from tgw.broker.config.schema import Config
    except ImportError:
        from tgw.broker.schema import Config    # before the broker's regroup
    return Config


def _unwrap(ann):
    """(the type with Optional and Annotated taken off, its constraints, whether None is allowed)."""
    meta, nullable = [], False
    while True:
        origin = typing.get_origin(ann)
        if origin is typing.Annotated:
            args = typing.get_args(ann)
            ann = args[0]
            for extra in args[1:]:
                meta += list(getattr(extra, "metadata", [extra]))
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(ann) if a is not type(None)]
            nullable = nullable or len(args) < len(typing.get_args(ann))
            if len(args) != 1:
                return typing.Union[tuple(args)], meta, nullable
            ann = args[0]
        else:
            return ann, meta, nullable


def _model(ann) -> type[BaseModel] | None:
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _num(v, bytesy: bool) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if bytesy and v >= 1024:
        for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if v % (1 << shift) == 0:
                return f"{v >> shift} {unit}"
    if not bytesy and v >= 1 << 20 and v & (v - 1) == 0:
        return f"2^{v.bit_length() - 1}"
    return str(v)


def _constraints(meta, bytesy: bool) -> tuple[str, list[str]]:
    """(the numeric range, the other constraints) in words."""
    got = {}
    for m in meta:
        for attr in ("ge", "gt", "le", "lt", "min_length", "max_length", "pattern"):
            if getattr(m, attr, None) is not None:
                got[attr] = getattr(m, attr)
    lo = ("ge", got["ge"]) if "ge" in got else ("gt", got["gt"]) if "gt" in got else None
    hi = ("le", got["le"]) if "le" in got else ("lt", got["lt"]) if "lt" in got else None
    n = lambda v: _num(v, bytesy)   # noqa: E731
    if lo and hi and lo[0] == "ge" and hi[0] == "le":
        rng = f"{n(lo[1])}..{n(hi[1])}"
    elif lo and hi:
        rng = f"{'[' if lo[0] == 'ge' else '('}{n(lo[1])}, {n(hi[1])}{']' if hi[0] == 'le' else ')'}"
    elif lo:
        rng = f"{'≥' if lo[0] == 'ge' else '>'} {n(lo[1])}"
    elif hi:
        rng = f"{'≤' if hi[0] == 'le' else '<'} {n(hi[1])}"
    else:
        rng = ""
    other = []
    if "pattern" in got:
        other.append(PATTERNS.get(got["pattern"], f"matching `{got['pattern']}`"))
    if "max_length" in got:
        other.append(f"at most {got['max_length']} long")
    return rng, other


def _values(ann, bytesy: bool = False, field_meta: list | None = None) -> str:
    """A field's type and range in words (pydantic keeps a field's own constraints apart, in
    field_meta)."""
    ann, meta, nullable = _unwrap(ann)
    meta = list(field_meta or []) + meta
    origin = typing.get_origin(ann)
    rng, other = _constraints(meta, bytesy)
    nonempty = any(getattr(m, "min_length", 0) == 1 for m in meta)
    if origin is typing.Literal:
        text = " \\| ".join(f"`{a}`" for a in typing.get_args(ann))
    elif origin in (typing.Union, types.UnionType):
        text = " or ".join(_values(a, bytesy) for a in typing.get_args(ann))
    elif origin is list:
        item = typing.get_args(ann)[0]
        text = ("non-empty list of " if nonempty else "list of ") + \
            ("entries" if _model(_unwrap(item)[0]) else _values(item, bytesy))
        nonempty = False
    elif origin is dict:
        key, value = typing.get_args(ann)
        text = f"map: name ({_values(key)}) → " + ("entry" if _model(value) else _values(value))
    elif _model(ann):
        text = "section"
    else:
        text = {int: "integer", float: "number", bool: "boolean", str: "string"}.get(ann, getattr(ann, "__name__", str(ann)))
        if rng:
            text += f" {rng}"
    if nonempty:
        text = "non-empty " + text
    if other:
        text += " " + ", ".join(other)
    if nullable:
        text += " or null"
    return text


def _default(field, bytesy: bool) -> str:
    if field.is_required():
        return "required"
    v = field.get_default(call_default_factory=True)
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return _num(v, bytesy)
    if isinstance(v, str):
        return f'`"{v}"`' if v.isdigit() else f"`{v}`"
    if isinstance(v, (list, dict)):
        return f"`{v!r}`".replace("'", "")
    raise TypeError(f"no rendering for the default {v!r}")


def keys(model: type[BaseModel] | None = None, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key path, values, default) for every key of the schema, in its order. Sections that are
    always there have no row of their own; optional sections, lists and maps of entries do."""
    rows = []
    for name, field in (model or schema_config()).model_fields.items():
        path, bytesy = prefix + name, name.endswith("_bytes")
        inner, _, _ = _unwrap(field.annotation)
        origin = typing.get_origin(inner)
        sub = _model(inner)
        if sub is not None:
            if field.is_required() or field.get_default() is None:
                rows.append((path, _values(field.annotation, field_meta=field.metadata), _default(field, bytesy)))
            rows += keys(sub, path + ".")
            continue
        rows.append((path, _values(field.annotation, bytesy, field.metadata), _default(field, bytesy)))
        if origin is list and _model(_unwrap(typing.get_args(inner)[0])[0]):
            rows += keys(_unwrap(typing.get_args(inner)[0])[0], path + "[].")
        elif origin is dict and _model(typing.get_args(inner)[1]):
            rows += keys(typing.get_args(inner)[1], path + ".NAME.")
    return rows


def _cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def meanings(doc: str) -> dict[str, str]:
    """key -> its meaning, from the table as committed."""
    table = doc.split(START, 1)[1].split(END, 1)[0] if START in doc else ""
    out = {}
    for line in table.splitlines():
        cells = _cells(line) if line.startswith("| `") else []
        if len(cells) == 4:
            out[cells[0].strip("`")] = cells[3]
    return out


def table(known: dict[str, str]) -> str:
    lines = [HEADER]
    for key, values, default in keys():
        lines.append(f"| `{key}` | {values} | {default} | {known.get(key) or UNDOCUMENTED} |")
    return "\n".join(lines)


def rebuilt(doc: str) -> str:
    """The doc with its table as the schema gives it (meanings kept)."""
    if START not in doc or END not in doc:
        raise SystemExit(f"{DOC}: the markers {START} and {END} are missing")
    head, rest = doc.split(START, 1)
    return f"{head}{START}\n{table(meanings(doc))}\n{END}{rest.split(END, 1)[1]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    args = ap.parse_args()
    with open(DOC) as f:
        doc = f.read()
    new = rebuilt(doc)
    undocumented = [k for k, _, _ in keys() if not meanings(new).get(k) or meanings(new)[k] == UNDOCUMENTED]
    if args.check:
        if new != doc:
            print(f"{DOC}: the key table differs from the schema; run python scripts/config-table.py", file=sys.stderr)
            return 1
    elif new != doc:
        with open(DOC, "w") as f:
            f.write(new)
        print(f"rewrote the key table of {DOC}")
    if undocumented:
        print(f"keys without a meaning ({UNDOCUMENTED}): {', '.join(undocumented)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
