"""A Triton model repository (`model_repository:`, `tgw-broker start --model-repository`) merged
into the raw config before validation: its models and pipelines beside the config's own, its
folder a model root. A name the config already declares is an error; so is every refusal of the
translation (broker/triton_repo/), and a translated model tgw's schema rejects, named by its
repository folder rather than a key path the user never wrote."""
from __future__ import annotations

import os

from pydantic import ValidationError

from .schema_models import ModelDecl

KEY = "model_repository"


def merged(data: dict, base_dir: str) -> tuple[dict, list[str], list[str]]:
    """(the raw config with the repository's entries added, problems, warnings); `data` unchanged
    when it names no repository (or names it malformed: the schema reports that)."""
    directory = data.get(KEY)
    if not isinstance(directory, str) or not directory:
        return data, [], []
    from tgw.broker.triton_repo import translate_repository   # protobuf only for a repository
    root = os.path.realpath(os.path.join(base_dir, directory))
    if not os.path.isdir(root):
        return data, [f"  {KEY}: not a directory: {root}"], []
    found = translate_repository(root)
    problems, models = [f"  {KEY}: {r}" for r in found.refusals], []
    for m in found.models:   # one that fails is reported here, by its folder, and not merged
        try:
            ModelDecl.model_validate(m)
            models.append(m)
        except ValidationError as err:
            problems += [f"  {KEY}: model {m['name']} ({os.path.join(root, m['name'], 'config.pbtxt')}): "
                         f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: "
                         f"{e['msg'].removeprefix('Value error, ')}" for e in err.errors()]
    own = {e.get("name"): f"{section}.{i}" for section in ("models", "pipelines")
           for i, e in enumerate(data.get(section) or []) if isinstance(e, dict)}
    for entry in [*models, *found.pipelines]:
        if entry["name"] in own:
            problems.append(f"  {KEY}: model {entry['name']} of {root} has the name of {own[entry['name']]} "
                            "in the config: a served name is declared once")
    out = dict(data)
    out["models"] = [*(data.get("models") or []), *models]
    if found.pipelines:
        out["pipelines"] = [*(data.get("pipelines") or []), *found.pipelines]
    roots = data.get("model_roots", [])
    if isinstance(roots, list):   # the repository's files lie in it; an empty list meant the config's folder
        out["model_roots"] = [*(roots or [base_dir]), root]
    return out, problems, found.warnings
