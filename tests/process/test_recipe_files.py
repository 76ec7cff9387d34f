"""The recipes under configs/ checked by the tools that will run them, without running them.

HAProxy's and nginx's own config checks on each recipe, as shipped and rendered for real ports
(tests/recipes.py); the systemd template against `tgw-broker start`'s real parser, against the
single-broker unit it is built on, and through `systemd-analyze verify` where that can run.
And the Kubernetes container config through `tgw-broker check-config`, its mount as the model root.
tests/process/test_recipes.py runs the balancers for real; tests/unit/test_recipes_kubernetes.py
checks the Kubernetes manifests against their schemas and each other.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import zipfile

import pytest
import yaml

from conftest import readme_block, unloaded_model
from recipes import (HAPROXY_RECIPES, NGINX_RECIPES, NOT_INSTALLED, ROOT, free_port, render_haproxy,
                     render_nginx, tool, unit_directives)

KUBE = os.path.join(ROOT, "configs", "kubernetes")
TEMPLATE = os.path.join(ROOT, "configs", "systemd", "tgw@.service")
SINGLE = os.path.join(ROOT, "scripts", "systemd", "tgw-broker.service")
PER_INSTANCE = {"Unit.Description", "Service.ExecStartPre", "Service.ExecStart", "Service.RuntimeDirectory",
                "Service.StateDirectory"}


def check(argv: list[str], cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=cwd)


@pytest.mark.parametrize("recipe", HAPROXY_RECIPES, ids=os.path.basename)
def test_haproxy_accepts_each_recipe_as_shipped_and_rendered(recipe, tmp_path):
    if not tool("haproxy"):
        pytest.skip(NOT_INSTALLED.format("haproxy"))
    rendered = tmp_path / "tgw.cfg"
    rendered.write_text(render_haproxy(recipe, f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}",
                                       [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]))
    for path in (recipe, str(rendered)):
        out = check([tool("haproxy"), "-c", "-f", path], str(tmp_path))
        assert out.returncode == 0 and "Configuration file is valid" in out.stdout, out.stdout + out.stderr
    text = rendered.read_text()
    assert text.count("    server tgw") == 2 and "retry-on conn-failure empty-response response-timeout 503" in text
    assert "http-check send meth GET uri /v2/health/ready" in text and "option redispatch" in text
    assert ("balance hdr(tgw-balance-key)" in text and "hash-type consistent" in text and
            "%[req.hdr(tgw-sequence-id)] if { req.hdr(tgw-sequence-id) -m found }" in text) == recipe.endswith("-hash.cfg")


@pytest.mark.parametrize("recipe", NGINX_RECIPES, ids=os.path.basename)
def test_nginx_accepts_each_recipe_rendered_in_a_private_prefix(recipe, tmp_path):
    if not tool("nginx"):
        pytest.skip(NOT_INSTALLED.format("nginx"))
    prefix = str(tmp_path)
    main = render_nginx(recipe, prefix, free_port(), [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"])
    out = check([tool("nginx"), "-t", "-p", prefix + "/", "-c", main], prefix)
    assert out.returncode == 0 and "test is successful" in out.stderr, out.stdout + out.stderr
    text = open(os.path.join(prefix, "tgw.conf")).read()
    assert "proxy_next_upstream error timeout http_503 non_idempotent;" in text
    assert ("hash $tgw_balance_key consistent;" in text and "default $http_tgw_sequence_id;" in text) == \
        recipe.endswith("-hash.conf")
    assert ("least_conn;" in text) != recipe.endswith("-hash.conf")


def test_the_template_starts_one_broker_per_instance_config():
    from tgw.broker.cli.main import build_parser
    unit = unit_directives(open(TEMPLATE).read())
    (pre,), (start,) = unit["Service.ExecStartPre"], unit["Service.ExecStart"]
    assert shlex.split(pre) == ["/opt/tgw/.venv/bin/tgw-broker", "check-config", "/etc/tgw/%i.yaml"]
    argv = shlex.split(start)
    assert argv[0] == "/opt/tgw/.venv/bin/tgw-broker"
    args = build_parser().parse_args(argv[1:])   # the real parser: an unknown flag fails here
    assert args.cmd == "start" and args.config == "/etc/tgw/%i.yaml"
    assert args.address is None and args.http_port is None   # socket and ports come from the config
    assert unit["Service.RuntimeDirectory"] == ["tgw/%i"] and unit["Service.StateDirectory"] == ["tgw/%i"]


def test_the_template_keeps_every_other_setting_of_the_single_broker_unit():
    template, single = unit_directives(open(TEMPLATE).read()), unit_directives(open(SINGLE).read())
    differ = {k: (single.get(k), template.get(k)) for k in set(single) | set(template)
              if k not in PER_INSTANCE and single.get(k) != template.get(k)}
    assert not differ, f"tgw@.service and tgw-broker.service differ in (single, template): {differ}"


def test_the_docs_instance_config_passes_check_config(tmp_path):
    """docs/SCALE-OUT.md's /etc/tgw/gpu0.yaml, its model folder moved into tmp: valid, and its
    socket and port are what the template's runtime folder and the balancer recipes expect."""
    text = readme_block("scale-out-example:instance").replace("/var/lib/tgw/models", str(tmp_path))
    cfg = yaml.safe_load(text)
    assert cfg["server"]["address"].startswith("ipc:///run/tgw/gpu0/") and cfg["http"]["port"] == 8000
    assert " 127.0.0.1:8000 check" in open(HAPROXY_RECIPES[0]).read()
    unloaded_model(str(tmp_path / "mlp-v1.pt"))
    (tmp_path / "gpu0.yaml").write_text(text)
    broker = os.path.join(os.path.dirname(sys.executable), "tgw-broker")
    out = check([broker, "check-config", str(tmp_path / "gpu0.yaml")], str(tmp_path))
    assert out.returncode == 0 and "OK (1 model(s): mlp)" in out.stdout, out.stdout + out.stderr


def systemd_analyze(unit: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", "--man=no", unit], capture_output=True, text=True,
                          timeout=60, cwd=cwd, env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""})


def test_an_instance_of_the_template_passes_systemd_analyze_verify(tmp_path):
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    probe = tmp_path / "tgw-probe.service"
    probe.write_text(f"[Service]\nType=oneshot\nExecStart={shutil.which('true') or '/bin/true'}\n")
    try:
        result = systemd_analyze(str(probe), str(tmp_path))
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"systemd-analyze cannot run here: {exc}")
    if result.returncode != 0 or (result.stdout + result.stderr).strip():
        pytest.skip(f"systemd-analyze verify fails on a trivial unit here: {(result.stdout + result.stderr)[:300]}")
    # verify wants the binaries to exist: /opt/tgw/ moves into tmp, with a stub tgw-broker there
    broker = tmp_path / "opt" / "tgw" / ".venv" / "bin" / "tgw-broker"
    broker.parent.mkdir(parents=True)
    broker.write_text("#!/bin/sh\nexit 0\n")
    broker.chmod(0o755)
    instance = tmp_path / "tgw@gpu0.service"
    instance.write_text(open(TEMPLATE).read().replace("/opt/tgw/", f"{tmp_path}/opt/tgw/"))
    result = systemd_analyze(str(instance), str(tmp_path))
    lines = [ln for ln in (result.stdout + result.stderr).splitlines() if ln.strip()]
    ours = [ln for ln in lines if "tgw@" in ln]
    assert not ours and result.returncode == 0, "systemd-analyze verify:\n" + "\n".join(lines)


def pt2_placeholder(path: str) -> None:
    """A file check-config takes for a torch.export program (shm/model_format.py reads only its zip
    directory); no worker could load it."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/archive_format", "pt2")
        archive.writestr("archive/models/model.json", "{}")


def test_the_container_config_passes_check_config_with_the_mount_as_model_root(tmp_path):
    shutil.copy(os.path.join(KUBE, "tgw.yaml"), tmp_path / "tgw.yaml")
    with open(tmp_path / "tgw.yaml") as f:
        cfg = yaml.safe_load(f)
    assert "model_roots" not in cfg, "the default (the config's folder, /mnt/models) is the model root"
    assert cfg["http"]["host"] == cfg["grpc"]["host"] == "0.0.0.0"   # probes reach the pod's IP
    for model in cfg["models"]:
        for version in model["versions"]:
            assert not os.path.isabs(version["path"]), "model paths are relative to /mnt/models"
            pt2_placeholder(str(tmp_path / version["path"]))
    broker = os.path.join(os.path.dirname(sys.executable), "tgw-broker")
    out = check([broker, "check-config", "tgw.yaml"], str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "version 1 (export)" in out.stdout
