"""`tgw-broker models convert DIR`: a Triton model repository printed as the equivalent tgw YAML
(model_roots, models, pipelines), for those who move on from config.pbtxt. What tgw does not
honour is in comments on top; a refusal also goes to stderr and makes the exit status 1."""
from __future__ import annotations

import os
import sys

import yaml

from tgw.broker.config.repository import KEY, merged


def add_verb(verbs) -> None:
    convert = verbs.add_parser("convert", help="print a Triton model repository (config.pbtxt per model) as the "
                                               "equivalent tgw YAML")
    convert.add_argument("dir", metavar="DIR", help="the repository: one folder per model")
    convert.set_defaults(local=run)


def run(args) -> int:
    root = os.path.realpath(args.dir)
    data, problems, warnings = merged({KEY: root, "model_roots": [root]}, root)
    data = {"model_roots": [root], "models": data.get("models", []), **({"pipelines": data["pipelines"]}
                                                                        if data.get("pipelines") else {})}
    head = [f"# tgw config of the Triton model repository {root} (tgw-broker models convert)"]
    head += [f"# warning: {w}" for w in warnings]
    head += [f"# refused: {p.strip()}" for p in problems]
    sys.stdout.write("\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False, width=100))
    for p in problems:
        print(f"refused: {p.strip()}", file=sys.stderr)
    return 1 if problems else 0
