"""configs/kubernetes/ checked without a cluster, against the published schemas.

Core objects (Deployment, Service, HPA, ConfigMap, and the containers and volumes inside KServe's
objects) through the kubernetes client's models: every key must be one of the model's
attributes (attribute_map), recursively by openapi_types, with the right kind of value, and
every required field present (the model's constructor refuses a missing one). KServe's
ClusterServingRuntime and InferenceService against their CRDs' OpenAPI schema (vendored,
pruned: tests/data/kserve-schemas.yaml says from where), with jsonschema and the same
unknown-key rule the API server's pruning applies. Then the manifests against each other and
against tgw itself: the runtime's and the Deployment's args parse with `tgw-broker start`'s
real parser and name the ports the probes use. (That the container config passes check-config:
tests/process/test_recipe_files.py.)
"""
from __future__ import annotations

import os

import jsonschema
import kubernetes.client as k8s   # the dev extra has both (pyproject.toml)
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KUBE = os.path.join(ROOT, "configs", "kubernetes")
SCHEMAS = os.path.join(ROOT, "tests", "data", "kserve-schemas.yaml")
CORE = {("apps/v1", "Deployment"): "V1Deployment", ("v1", "Service"): "V1Service",
        ("v1", "ConfigMap"): "V1ConfigMap", ("autoscaling/v2", "HorizontalPodAutoscaler"): "V2HorizontalPodAutoscaler"}
PRIMITIVE = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "object": (object,),
             "datetime": (str,), "date": (str,), "bytes": (str,)}


def manifests() -> list[tuple[str, dict]]:
    found = []
    for name in sorted(os.listdir(KUBE)):
        if name.endswith(".yaml") and name != "tgw.yaml":   # tgw.yaml is tgw's config, not a manifest
            with open(os.path.join(KUBE, name)) as f:
                found += [(name, doc) for doc in yaml.safe_load_all(f) if doc is not None]
    return found


def by_kind(kind: str) -> dict:
    (doc,) = [d for _, d in manifests() if d["kind"] == kind]
    return doc


def container_type(type_name: str) -> tuple[str, str] | None:
    """("list" | "dict", the element type) for "List[X]" / "Dict[str, X]" (kubernetes 33 and later)
    and "list[X]" / "dict(str, X)" (the older generator); None for any other type."""
    for kind, opens in (("list", ("List[", "list[")), ("dict", ("Dict[", "dict("))):
        if type_name.startswith(opens):
            inner = type_name[5:-1]
            return kind, inner.split(", ", 1)[1] if kind == "dict" else inner
    return None


def required_fields(cls, given: dict) -> list[str]:
    """The model's required attributes that `given` (attribute -> value) leaves out."""
    fields = getattr(cls, "model_fields", None)
    if fields is not None:   # pydantic models (kubernetes 33 and later)
        return [a for a, f in fields.items() if f.is_required() and a not in given]
    try:                     # the older generator's constructor refuses a required None
        cls(**{a: v if cls.openapi_types[a] in PRIMITIVE else object() for a, v in given.items()})
    except ValueError as exc:
        return [str(exc)]
    return []


def model_problems(value, type_name: str, path: str) -> list[str]:
    """What the kubernetes client's model `type_name` finds wrong with `value` (a parsed manifest part)."""
    nested = container_type(type_name)
    if nested and nested[0] == "list":
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {value!r}"]
        return [p for i, v in enumerate(value) for p in model_problems(v, nested[1], f"{path}[{i}]")]
    if nested:
        if not isinstance(value, dict):
            return [f"{path}: expected a map, got {value!r}"]
        return [p for k, v in value.items() for p in model_problems(v, nested[1], f"{path}.{k}")]
    if type_name in PRIMITIVE:
        # a YAML true is no int: bool is a subclass of int in Python, not in the API
        ok = isinstance(value, PRIMITIVE[type_name]) and (type_name in ("bool", "object")
                                                          or not isinstance(value, bool))
        return [] if ok else [f"{path}: expected {type_name}, got {value!r}"]
    cls = getattr(k8s, type_name)
    if not isinstance(value, dict):
        return [f"{path}: expected a {type_name} map, got {value!r}"]
    attrs = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    problems = [f"{path}.{k}: not a field of {type_name}" for k in value if k not in attrs]
    given = {attrs[k]: v for k, v in value.items() if k in attrs}
    for attr, v in given.items():
        problems += model_problems(v, cls.openapi_types[attr], f"{path}.{cls.attribute_map[attr]}")
    problems += [f"{path}: {type_name} requires {cls.attribute_map.get(r, r)}" for r in required_fields(cls, given)]
    return problems


def crd_problems(value, schema: dict, path: str) -> list[str]:
    """Keys the CRD does not declare (the API server would prune them), and values below a part
    of the vendored schema that was pruned away."""
    if schema.get("x-tgw-pruned"):
        return [f"{path}: tests/data/kserve-schemas.yaml was pruned here; rerun tests/data/prune-kserve-crds.py"]
    problems = []
    extra = schema.get("additionalProperties")
    if isinstance(value, dict) and ("properties" in schema or isinstance(extra, dict)):
        for k, v in value.items():
            if k in schema.get("properties", {}):
                problems += crd_problems(v, schema["properties"][k], f"{path}.{k}")
            elif isinstance(extra, dict):
                problems += crd_problems(v, extra, f"{path}.{k}")
            elif not schema.get("x-kubernetes-preserve-unknown-fields"):
                problems.append(f"{path}.{k}: not in the CRD's schema")
    elif isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            problems += crd_problems(v, schema["items"], f"{path}[{i}]")
    return problems


@pytest.mark.parametrize("name,doc", manifests(), ids=lambda x: x if isinstance(x, str) else x["kind"])
def test_every_manifest_matches_its_published_schema(name, doc):
    where = f"{name}: {doc['kind']}"
    if (doc["apiVersion"], doc["kind"]) in CORE:
        problems = model_problems(doc, CORE[doc["apiVersion"], doc["kind"]], where)
    else:
        with open(SCHEMAS) as f:
            vendored = yaml.safe_load(f)[doc["kind"]]
        assert doc["apiVersion"] == vendored["apiVersion"], f"{where}: the CRD serves {vendored['apiVersion']}"
        errors = jsonschema.Draft7Validator(vendored["schema"]).iter_errors(doc)
        problems = [f"{where}.{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
        problems += crd_problems(doc, vendored["schema"], where)
        problems += model_problems(doc["metadata"], "V1ObjectMeta", f"{where}.metadata")
        spec = doc["spec"]
        for i, container in enumerate(spec.get("containers", [])):
            problems += model_problems(container, "V1Container", f"{where}.spec.containers[{i}]")
        for i, volume in enumerate(spec.get("volumes", [])):
            problems += model_problems(volume, "V1Volume", f"{where}.spec.volumes[{i}]")
    assert not problems, "\n".join(problems)


def test_the_checker_catches_unknown_keys_and_missing_fields():
    deployment = by_kind("Deployment")
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    del broken["spec"]["selector"]
    problems = model_problems(broken, "V1Deployment", "d")
    assert any("d.spec.replica: not a field" in p for p in problems), problems
    assert any("requires selector" in p or "`selector`, must not be `None`" in p for p in problems), problems
    runtime = by_kind("ClusterServingRuntime")
    with open(SCHEMAS) as f:
        schema = yaml.safe_load(f)["ClusterServingRuntime"]["schema"]
    assert crd_problems({**runtime, "spec": {**runtime["spec"], "containerz": []}}, schema, "r") == \
        ["r.spec.containerz: not in the CRD's schema"]


def start_args(container: dict):
    from tgw.broker.cli.main import build_parser
    assert container["command"] == ["tgw-broker"]
    args = build_parser().parse_args(container["args"])   # exits (fails the test) on an unknown flag
    assert args.cmd == "start" and args.config == "/mnt/models/tgw.yaml"
    return args


def probe_ports(container: dict) -> dict:
    names = {p["name"]: p["containerPort"] for p in container["ports"]}
    found = {}
    for probe, path in (("startupProbe", "/v2/health/live"), ("livenessProbe", "/v2/health/live"),
                        ("readinessProbe", "/v2/health/ready")):
        get = container[probe]["httpGet"]
        assert get["path"] == path, f"{probe} asks {get['path']}, not {path}"
        found[probe] = names.get(get["port"], get["port"])
    return found


@pytest.mark.parametrize("kind", ["ClusterServingRuntime", "Deployment"])
def test_the_containers_start_tgw_on_the_ports_their_probes_and_services_use(kind):
    doc = by_kind(kind)
    pod = doc["spec"]["template"]["spec"] if kind == "Deployment" else doc["spec"]
    (container,) = pod["containers"]
    args = start_args(container)
    ports = [p["containerPort"] for p in container["ports"]]
    assert ports == [args.http_port, args.grpc_port] and "grpc" in container["ports"][1]["name"]
    assert set(probe_ports(container).values()) == {args.http_port}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"   # not the container's 64 MiB
    if kind == "Deployment":
        assert mounts["/mnt/models"] in volumes
        service = by_kind("Service")
        assert service["spec"]["selector"].items() <= doc["spec"]["template"]["metadata"]["labels"].items()
        assert {p["targetPort"] for p in service["spec"]["ports"]} == {p["name"] for p in container["ports"]}


def test_the_inference_service_uses_the_runtime_for_a_format_it_declares():
    runtime, isvc = by_kind("ClusterServingRuntime"), by_kind("InferenceService")
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert formats == {"pytorch-torchscript", "pytorch-export", "pytorch-aoti"}
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"] and model["modelFormat"]["name"] in formats
    assert {"v2", "grpc-v2"} <= set(runtime["spec"]["protocolVersions"])


def test_the_hpa_scales_the_deployment_on_the_metric_the_adapter_serves():
    hpa, deployment, adapter = by_kind("HorizontalPodAutoscaler"), by_kind("Deployment"), by_kind("ConfigMap")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    served = {r["name"]["as"] for r in rules}
    assert {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]} <= served
    assert all(r["seriesQuery"].startswith("tgw_queue_depth{") for r in rules)
    with open(os.path.join(ROOT, "broker", "observe", "metrics.py")) as f:
        assert '"tgw_queue_depth"' in f.read()   # the process test reads it from a real /metrics too
