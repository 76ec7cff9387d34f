"""Bad flags to `tgw-broker` are one clear line on stderr and a non-zero exit: no traceback,
nothing started."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

CASES = [
    (["start", "--address", "foo://x"], "--address 'foo://x': no ipc:// or tcp:// scheme"),
    (["start", "--address", "tcp://127.0.0.1"], "no :PORT after the host"),
    (["start", "--log-level", "verbose"], "--log-level 'verbose': not one of DEBUG"),
    (["status", "--address", "foo"], "bad broker address 'foo': no ipc:// or tcp:// scheme"),
    (["status", "--address", "/tmp/tgw.sock"], "(ipc:///tmp/tgw.sock?)"),
    (["metrics", "--address", "tcp://:5555"], "no host to connect to"),
]


@pytest.mark.parametrize("argv,says", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_flags_are_one_line_and_a_failure(argv, says):
    r = subprocess.run([sys.executable, "-m", "tgw.broker", *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert says in lines[0], lines[0]
    assert r.stdout == ""


def test_a_closed_pipe_ends_quietly(tmp_path):
    """`tgw-broker ... | head -1`: the reader gone before the output is written is exit 141 (128 +
    SIGPIPE) and nothing on stderr, not a BrokenPipeError traceback (keygen: output, no broker)."""
    read_end, write_end = os.pipe()
    os.close(read_end)   # the reader has gone: every write fails with EPIPE
    try:
        r = subprocess.run([sys.executable, "-m", "tgw.broker", "keygen", str(tmp_path)], stdout=write_end,
                           stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert (r.returncode, r.stderr) == (141, "")
    assert (tmp_path / "broker.key").exists()   # the command itself ran
