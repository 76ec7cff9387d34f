"""The documents stay true: README.md and docs/*.md checked against the code they describe.

* README's minimal config validates as printed;
* configs/example.yaml validates with the real loader and sets or shows every schema key;
* docs/CONFIGURATION.md's key table is what scripts/config-table.py makes of the schema, and a
  default quoted elsewhere in the docs ("`workers.start_timeout_s` (120)") is the schema's;
* docs/ARCHITECTURE.md names every module under broker/, and no module that is gone;
* docs/PROTOCOL.md section 11's bytes are what tgw.shm.wire's encoder writes;
* every code-block marker occurs once and is run by a test; README lists every document; every
  relative link and anchor resolves.

The other doc tests: tests/process/test_client_readme.py (the client examples, the quick-start
one included), tests/process/test_http.py (examples),
tests/process/test_formats.py (the export recipe), tests/process/test_metrics.py (the metric table).
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import re

import msgspec
import pytest
import yaml
from conftest import readme_block, unloaded_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
EXAMPLE = os.path.join(ROOT, "configs", "example.yaml")

# every code-block marker in the docs, and the test that runs its block
MARKERS = {
    "client-example:quickstart": "test_client_readme.py::test_readme_quickstart_example_runs_as_printed",
    "config-example:minimal": "test_docs.py::test_readme_minimal_config_example_validates",
    "client-example:async": "test_client_readme.py",
    "client-example:stream": "test_client_readme.py",
    "client-example:region": "test_client_readme.py",
    "http-example:python": "test_http.py::test_readme_examples_work_as_printed",
    "http-example:curl": "test_http.py::test_readme_examples_work_as_printed",
    "http-example:raw": "test_http_raw_bodies.py::test_the_docs_raw_body_and_binary_extension_examples_run_as_printed",
    "http-example:jpeg": "test_http_raw_bodies.py::test_the_docs_raw_body_and_binary_extension_examples_run_as_printed",
    "model-export": "test_formats.py::test_the_readmes_recipe_writes_a_file_of_each_format_that_serves_every_batch",
    "stage-example:handler": "test_stages.py",
    "stage-example:config": "test_stages.py",
    "triton-python-example:config": "test_triton_python.py::test_the_add_sub_example_runs_unchanged",
    "triton-repository-example:scale": "test_triton_repository.py::test_a_repository_of_each_platform_serves_unchanged",
    "http-example:statistics": "test_http_triton_docs.py::test_the_docs_example_runs_as_printed",
    "http-example:generate": "test_http_generate.py::test_generate_and_generate_stream_answer_the_native_tokens",
    "grpc-example:python": "test_grpc.py::test_doc_example_runs_as_printed",
    "grpc-example:decoupled": "test_grpc_streams.py::test_doc_example_runs_as_printed",
    "pipeline-example:config": "test_check_config.py::test_the_docs_example_passes_check_config",
    "shm-example:python": "test_triton_shm.py::test_the_docs_example_runs_as_printed",
    "load-example:curl": "test_readiness.py::test_the_docs_load_example_runs_as_printed",
    "scale-out-example:instance": "test_recipe_files.py::test_the_docs_instance_config_passes_check_config",
    "generator-example:config": "test_demo_generator.py::test_the_docs_config_is_the_demos_declaration",
    "generator-example:handler": "test_demo_generator.py::test_the_docs_handler_excerpt_is_the_code",
    "generator-example:stream": "test_demo.py::test_the_generator_streams_what_the_model_generates_in_process",
    "openai-example:python": "test_openai.py::test_docs_example_runs_as_printed",
    "sequence-example:handler": "test_sequence_loop.py::test_the_docs_handler_is_the_demos_code",
}


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def config_table():
    """scripts/config-table.py as a module (its name is not importable)."""
    spec = importlib.util.spec_from_file_location("config_table", os.path.join(ROOT, "scripts", "config-table.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def loader():
    """The broker's config loader: tgw.broker.config re-exports it (before the regroup into
    wings it was the module itself)."""
    from tgw.broker import config
    return config.load_config, config.parse_config


# ---- the README's own examples ---------------------------------------------------------------

def test_readme_minimal_config_example_validates(tmp_path):
    (tmp_path / "tgw.yaml").write_text(readme_block("config-example:minimal"))
    unloaded_model(str(tmp_path / "model.pt2"))
    load_config, _ = loader()
    cfg = load_config(str(tmp_path / "tgw.yaml"))
    assert [m.name for m in cfg.models] == ["mymodel"] and cfg.http.port == 8000
    assert cfg.models[0].versions[0].path == str(tmp_path / "model.pt2")


# ---- configs/example.yaml --------------------------------------------------------------------

def test_example_config_validates_with_the_real_loader(tmp_path):
    """The example with its model folder pointed at files of its own (placeholders the config
    check takes for TorchScript archives) and the sha256 placeholder replaced by the file's."""
    text = read(EXAMPLE)
    assert "/var/lib/tgw/models" in text
    for i, name in enumerate(("mlp-v1.pt", "mlp-v2.pt", "resnet-v1.pt", "embed-v1.pt", "accumulator-v1.pt")):
        unloaded_model(str(tmp_path / name), salt=bytes([i]))
    digest = hashlib.sha256((tmp_path / "mlp-v2.pt").read_bytes()).hexdigest()
    text = text.replace("/var/lib/tgw/models", str(tmp_path)).replace("0" * 64, digest)
    (tmp_path / "example.yaml").write_text(text)
    load_config, _ = loader()
    cfg = load_config(str(tmp_path / "example.yaml"))
    assert [m.name for m in cfg.models] == ["mlp", "resnet", "embed", "top5", "tiny-gpt", "accumulator"]
    assert [p.name for p in cfg.pipelines] == ["classify-logits"] and cfg.workers.stage_workers == 1
    assert cfg.workers.cuda_host_memory == "register" and cfg.http is not None


def _present(node, parts: list[str]) -> bool:
    """Whether the key path (`models[].breaker.error_rate`, `tenants.NAME.rate`) is set in a
    parsed YAML tree: in any element of a list, any value of a map of names."""
    if not parts:
        return True
    head, rest = parts[0], parts[1:]
    if head == "NAME":
        return isinstance(node, dict) and any(_present(v, rest) for v in node.values())
    key, is_list = (head[:-2], True) if head.endswith("[]") else (head, False)
    if not isinstance(node, dict) or key not in node:
        return False
    child = node[key]
    if is_list:
        return isinstance(child, list) and any(_present(item, rest) for item in child)
    return _present(child, rest) if rest else True


def test_example_config_sets_or_shows_every_schema_key():
    """Every key is set in the example, or shown commented out (`# default_version: "1"`), as
    for keys that exclude another one the example sets."""
    text = read(EXAMPLE)
    data = yaml.safe_load(text)
    commented = set(re.findall(r"^\s*#\s*([a-z_0-9]+):", text, re.M))
    keys = [k for k, _, _ in config_table().keys()]
    missing = [k for k in keys if not _present(data, k.split(".")) and k.rsplit(".", 1)[-1] not in commented]
    assert len(keys) > 80 and missing == []


# ---- docs/CONFIGURATION.md -------------------------------------------------------------------

def test_configuration_doc_table_is_what_the_schema_gives():
    ct = config_table()
    doc = read(ct.DOC)
    assert ct.rebuilt(doc) == doc, "docs/CONFIGURATION.md's key table is stale: run python scripts/config-table.py"
    meanings = ct.meanings(doc)
    undocumented = [k for k, _, _ in ct.keys() if meanings.get(k, ct.UNDOCUMENTED) == ct.UNDOCUMENTED]
    assert undocumented == []


def test_config_table_renders_the_schema_defaults():
    """The generator itself: a few defaults as the schema states them, rendered for the table."""
    rows = {k: (values, default) for k, values, default in config_table().keys()}
    from tgw.broker.config import Config, WorkersDecl
    assert rows["server.max_request_bytes"][1] == "64 MiB" == f"{Config.model_fields['server'].default.max_request_bytes >> 20} MiB"
    assert rows["workers.cuda_host_memory"] == ("`register` \\| `staging` \\| `pageable`",
                                                f"`{WorkersDecl().cuda_host_memory}`")
    assert rows["models[].name"][1] == "required" and rows["models"][1] == "`[]`"   # none: a model store's
    assert rows["models[].max_batch_size"] == ("integer 0..4096", "32")
    assert rows["tenants"][1] == "`{}`" and rows["tenants.NAME.rate"][0] == "number > 0"


def _number(text: str):
    """A default as a number: "64 MiB" in bytes; "30 s" or "500 ms" in the key's own unit."""
    m = re.fullmatch(r"([0-9.]+)( (KiB|MiB|GiB|s|ms))?", text.strip())
    if not m:
        return None
    value = float(m.group(1))
    return value * {None: 1, "s": 1, "ms": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(3)]


def test_defaults_quoted_in_the_docs_are_the_schemas():
    """A default quoted beside a key, "`workers.start_timeout_s` (120)" or "`timeout_ms` (default
    30000)" (a key without its section: the one key that ends so), equals the schema's; and every
    full key path the docs name in backticks exists."""
    rows = {k: default for k, _, default in config_table().keys()}
    sections = ("server.", "workers.", "supervisor.", "warmup.", "http.", "observability.", "models[].",
                "tenants.NAME.")
    quoted, unknown, wrong = 0, [], []
    for path in DOCS:
        text = read(path)
        for key in re.findall(r"`((?:%s)[a-z_0-9.\[\]A-Z]*[a-z_0-9])" % "|".join(map(re.escape, sections)), text):
            if key.endswith(".py") or re.search(r"[A-Z]", key.replace("NAME", "")):
                continue   # a module (`server.py`, `http.face.FaceDeps`), not a key
            if key not in rows and not any(r.startswith(key + ".") for r in rows):
                unknown.append(f"{os.path.basename(path)}: {key}")
        for key, value in re.findall(r"`([a-z_][a-z_0-9.\[\]A-Z]*)` \((?:default )?([0-9.]+(?: [KMG]iB| m?s)?)\)", text):
            if key not in rows:   # a key named without its section: the one row it ends
                ends = [r for r in rows if r.endswith("." + key)]
                key = ends[0] if len(ends) == 1 else key
            if key in rows and _number(rows[key]) is not None:
                quoted += 1
                if _number(value) != _number(rows[key]):
                    wrong.append(f"{os.path.basename(path)}: {key} ({value}), the schema says {rows[key]}")
    assert unknown == [] and wrong == []
    assert quoted >= 3   # not vacuous: OPERATIONS.md and PROTOCOL.md quote some


# ---- docs/ARCHITECTURE.md --------------------------------------------------------------------

def test_architecture_doc_names_every_broker_module_and_no_other():
    doc = read(os.path.join(ROOT, "docs", "ARCHITECTURE.md"))
    section = doc.split("\n## Every broker module\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `([a-z0-9_/]+\.py)` \|", section, re.M)
    broker = os.path.join(ROOT, "broker")
    modules = sorted(os.path.relpath(p, broker) for p in glob.glob(os.path.join(broker, "**", "*.py"), recursive=True))
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert [m for m in modules if m not in listed] == [], "modules missing from docs/ARCHITECTURE.md"
    assert [m for m in listed if m not in modules] == [], "docs/ARCHITECTURE.md lists modules that do not exist"


# ---- docs/PROTOCOL.md section 11 -------------------------------------------------------------

def _blocks(text: str) -> list[str]:
    return re.findall(r"^```\n(.*?)^```$", text, re.M | re.S)


def test_protocol_worked_example_bytes_are_what_the_encoder_writes():
    from tgw.shm.wire import PROTOCOL_VERSION, Infer, InferReply, TensorMeta, encode
    request = encode(Infer(v=PROTOCOL_VERSION, id=1, model="mlp",
                           inputs=[TensorMeta(name="x", dtype="float32", shape=[1, 256])]))
    reply = encode(InferReply(v=PROTOCOL_VERSION, id=1, model="mlp", version="1",
                              outputs=[TensorMeta(name="y", dtype="float32", shape=[1, 10])]))
    doc = read(os.path.join(ROOT, "docs", "PROTOCOL.md"))
    section = doc.split("\n## 11. ", 1)[1].split("\n## ", 1)[0]
    hex_request, breakdown, hex_reply = _blocks(section)[:3]
    assert f"Frame 0, {len(request)} bytes:" in section
    assert "".join(hex_request.split()) == request.hex()
    # the annotated breakdown's left column spells the same bytes
    left = [re.split(r"\s{2,}", line.strip())[0] for line in breakdown.splitlines() if line.strip()]
    assert "".join("".join(cell.split()) for cell in left) == request.hex()
    assert f"frame 0 ({len(reply)} bytes)" in section
    assert "".join(hex_reply.split()) == reply.hex()
    shown = re.search(r"^i\.e\. `(\{.*\})`\.$", section, re.M).group(1)
    assert json.loads(shown) == msgspec.msgpack.decode(reply)
    assert f"PROTOCOL_VERSION = {PROTOCOL_VERSION}" in section


# ---- markers, the documents table, links -----------------------------------------------------

def test_every_code_block_marker_occurs_once_and_is_run_by_a_test():
    found = set()
    for path in DOCS:
        found |= set(re.findall(r"^<!-- ([a-z-]+(?::[a-z]+)?) -->$", read(path), re.M))
    found -= {"config-table:start", "config-table:end"}
    assert found == set(MARKERS)
    for marker in MARKERS:
        assert readme_block(marker).strip()   # once over all the docs, followed by a code block


def test_readme_lists_every_document():
    readme = read(os.path.join(ROOT, "README.md"))
    table = readme.split("\n## Documents\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| \[docs/([A-Z_-]+\.md)\]\(docs/\1\) \| \S", table, re.M)
    on_disk = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    assert sorted(listed) == on_disk


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, -1 … for repeats."""
    seen, out = {}, set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("path", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_doc_links_and_anchors_resolve(path):
    text = read(path)
    prose = re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            broken.append(target)
        elif anchor and dest.endswith(".md") and anchor not in _anchors(read(dest)):
            broken.append(target)
    assert broken == []


def test_paths_named_in_the_docs_exist():
    """A file the docs name (`broker/sched/batcher.py`, `scripts/gpu-check.sh`, `tests/faults/`)
    is there: a module that moves takes its mentions along."""
    pattern = r"(?<![/\w.~-])((?:broker|workers|shm|client|bench|tests|scripts|configs)/[A-Za-z0-9_./*-]*[A-Za-z0-9_*/])"
    missing = []
    for path in DOCS:
        for name in set(re.findall(pattern, read(path))):
            if not glob.glob(os.path.join(ROOT, name)):
                missing.append(f"{os.path.relpath(path, ROOT)}: {name}")
    assert missing == []
