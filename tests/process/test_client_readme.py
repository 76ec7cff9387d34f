"""The README's client examples (the quick start, async, streaming, regions) run as printed against
a real broker, each in a fresh interpreter, with `address` bound to the broker's (the quick start
reads it from TGW_ADDRESS)."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import base_config, readme_block

PRELUDE = "import numpy as np\nfrom tgw.client import Client\naddress = {address!r}\n"
AFTER = {"async": "\nasyncio.run(main(address))\n"}


def run_example(kind: str, address: str) -> list[str]:
    code = PRELUDE.format(address=address) + readme_block(f"client-example:{kind}") + AFTER.get(kind, "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_readme_client_examples_work_as_printed(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp", "resnet"))
    assert run_example("async", b.address) == ["1000 (1, 10)"]
    lines = run_example("stream", b.address)
    assert len(lines) <= 100 and all(line.endswith(" (1, 10)") for line in lines)
    assert run_example("region", b.address) == ["(4, 1000) 1"]


def test_readme_quickstart_example_runs_as_printed(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp"))
    env = {**os.environ, "TGW_ADDRESS": b.address}
    out = subprocess.run([sys.executable, "-c", readme_block("client-example:quickstart")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["['mlp']", "(4, 10)"]
