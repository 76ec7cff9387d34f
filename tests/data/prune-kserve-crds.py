"""Writes tests/data/kserve-schemas.yaml: KServe's CRD schemas, pruned to what configs/kubernetes/ uses.

Run from a checkout, with the two CRD files of a kserve/kserve checkout (config/crd/full/):
  python tests/data/prune-kserve-crds.py COMMIT CLUSTERSERVINGRUNTIMES_CRD INFERENCESERVICES_CRD
Every object the manifests use keeps all its property names (so the test catches an unknown
key); properties the manifests leave unset keep only their type, marked x-tgw-pruned.
"""
import os
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEEP = ("type", "format", "required", "enum", "pattern", "maxLength", "minLength", "minimum", "maximum",
        "maxItems", "minItems", "nullable", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
        "anyOf", "allOf", "oneOf")
KINDS = (("ClusterServingRuntime", "servingruntime.yaml"), ("InferenceService", "inferenceservice.yaml"))
HEADER = """\
# KServe's CRD schemas, the parts configs/kubernetes/ uses, for tests/unit/test_recipes_kubernetes.py.
# Source: the kserve/kserve repository on GitHub, commit {commit},
# config/crd/full/serving.kserve.io_clusterservingruntimes.yaml and
# config/crd/full/serving.kserve.io_inferenceservices.yaml: spec.versions[<the storage version>]
# .schema.openAPIV3Schema of each. Pruned: descriptions dropped; every object the manifests use
# keeps all its property names (so an unknown key is caught) with full schemas for the keys the
# manifests set and only type/format for the others (marked x-tgw-pruned: the test refuses a
# manifest value below one). Made by tests/data/prune-kserve-crds.py; rerun it when the
# manifests set new keys.
"""


def stub(schema: dict) -> dict:
    out = {k: schema[k] for k in KEEP if k in schema and k not in ("required", "anyOf", "allOf", "oneOf")}
    if any(k in schema for k in ("properties", "items", "additionalProperties")):
        out["x-tgw-pruned"] = True
    return out


def prune(schema: dict, values: list) -> dict:
    """`schema` cut down to what `values` (every manifest value at this point) reach."""
    out = {k: schema[k] for k in KEEP if k in schema}
    dicts = [v for v in values if isinstance(v, dict)]
    if "properties" in schema:
        out["properties"] = {}
        for name, sub in schema["properties"].items():
            used = [d[name] for d in dicts if name in d]
            out["properties"][name] = prune(sub, used) if used else stub(sub)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        out["additionalProperties"] = prune(extra, [v for d in dicts for k, v in d.items()
                                                    if k not in schema.get("properties", {})])
    elif extra is not None:
        out["additionalProperties"] = extra
    if "items" in schema:
        out["items"] = prune(schema["items"], [x for v in values if isinstance(v, list) for x in v])
    return out


def main(commit: str, *crds: str) -> None:
    result = {}
    for (kind, manifest), crd in zip(KINDS, crds):
        with open(crd) as f:
            definition = yaml.safe_load(f)
        with open(os.path.join(ROOT, "configs", "kubernetes", manifest)) as f:
            docs = [d for d in yaml.safe_load_all(f) if d["kind"] == kind]
        (version,) = [v for v in definition["spec"]["versions"] if v.get("storage")]
        result[kind] = {"apiVersion": f"{definition['spec']['group']}/{version['name']}",
                        "source": "config/crd/full/" + os.path.basename(crd),
                        "schema": prune(version["schema"]["openAPIV3Schema"], docs)}
    with open(os.path.join(ROOT, "tests", "data", "kserve-schemas.yaml"), "w") as f:
        f.write(HEADER.format(commit=commit))
        yaml.safe_dump(result, f, sort_keys=False, width=100)


if __name__ == "__main__":
    main(*sys.argv[1:])
