"""Triton model repositories (`model_repository:`, `tgw-broker start --model-repository`) merged
into the raw config before validation: their models and pipelines beside the config's own, each
repository's folder a model root. A name declared twice (in the config, or in two repositories)
is an error; so is every refusal of the translation (broker/triton_repo/), and a translated model
tgw's schema rejects, named by its repository folder rather than a key path the user never wrote."""
from __future__ import annotations

import os

from pydantic import ValidationError

from .schema_models import ModelDecl

KEY = "model_repository"


def repositories(data: dict) -> list[str]:
    """The repositories the raw config names: one folder or a list of them (else none: the schema
    reports a malformed key)."""
    given = data.get(KEY)
    folders = [given] if isinstance(given, str) else given if isinstance(given, list) else []
    return [f for f in folders if isinstance(f, str) and f]


def merged(data: dict, base_dir: str) -> tuple[dict, list[str], list[str]]:
    """(the raw config with the repositories' entries added, problems, warnings); `data`
    unchanged when it names no repository."""
    folders = repositories(data)
    if not folders:
        return data, [], []
    from tgw.broker.triton_repo import translate_repository   # protobuf only for a repository
    problems, warnings, models, pipelines, roots = [], [], [], [], []
    seen = {e.get("name"): f"{section}.{i} in the config" for section in ("models", "pipelines")
            for i, e in enumerate(data.get(section) or []) if isinstance(e, dict)}
    for folder in folders:
        root = os.path.realpath(os.path.join(base_dir, folder))
        if not os.path.isdir(root):
            problems.append(f"  {KEY}: not a directory: {root}")
            continue
        roots.append(root)
        found = translate_repository(root)
        problems += [f"  {KEY}: {r}" for r in found.refusals]
        warnings += found.warnings
        for entry in [*_valid(found.models, root, problems), *found.pipelines]:
            if entry["name"] in seen:
                problems.append(f"  {KEY}: model {entry['name']} of {root} has the name of {seen[entry['name']]}: "
                                "a served name is declared once")
                continue
            seen[entry["name"]] = f"model {entry['name']} of {root}"
            (pipelines if "steps" in entry else models).append(entry)
    out = dict(data)
    out["models"] = [*(data.get("models") or []), *models]
    if pipelines:
        out["pipelines"] = [*(data.get("pipelines") or []), *pipelines]
    given = data.get("model_roots", [])
    if isinstance(given, list):   # the repositories' files lie in them; an empty list meant the config's folder
        out["model_roots"] = list(dict.fromkeys([*(given or [base_dir]), *roots]))
    return out, problems, warnings


def _valid(models: list[dict], root: str, problems: list[str]) -> list[dict]:
    """The translated models the schema takes; each one it rejects reported, by its folder."""
    out = []
    for m in models:
        try:
            ModelDecl.model_validate(m)
            out.append(m)
        except ValidationError as err:
            problems += [f"  {KEY}: model {m['name']} ({os.path.join(root, m['name'], 'config.pbtxt')}): "
                         f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: "
                         f"{e['msg'].removeprefix('Value error, ')}" for e in err.errors()]
    return out
