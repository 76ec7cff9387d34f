"""Issue 39's frictions, met the way a new user meets them: one script that builds a small model
store, starts real brokers, runs the CLI, curl and the client, and prints what each step showed.

    .venv/bin/python scripts/newcomer-tour.py > bench/results/issue39-tour-after.txt
    BEFORE/.venv/bin/python scripts/newcomer-tour.py > bench/results/issue39-tour-before.txt

(BEFORE: a checkout of the commit before issue 39 with its own .venv: the tgw a python imports
is the one toured.) The two outputs are the closing note's before/after. Each section prints the commands it ran and their output (long output cut to its
first and last lines, with the number of lines), never a verdict: the reader compares.
Everything lives in a temporary folder; the brokers are started and stopped by PID.
"""
from __future__ import annotations

import asyncio
import json
import os
import pty
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request

import yaml

BIN = os.path.dirname(sys.executable)
BROKER = os.path.join(BIN, "tgw-broker")

STAGES = '''
import os, time, warnings
import numpy as np
from tgw.workers.stage import Stage, StageBatch, StageContext


class Length(Stage):
    """bytes -> their length: what a raw body reaches."""

    def __call__(self, batch: StageBatch) -> dict:
        return {"length": np.array([len(b) for b in batch["data"]], dtype=np.int64)}


class Broken(Stage):
    """A version with a typo: raises NameError on every call."""

    def __call__(self, batch: StageBatch) -> dict:
        return {"length": np.array([len(b) for b in batch[data]], dtype=np.int64)}


class Raises(Stage):
    """Fails a batch holding a row it cannot read with an exception from the handler's own code."""

    def __call__(self, batch: StageBatch) -> dict:
        if any(b.startswith(b"bad") for b in batch["data"]):
            raise ValueError("the handler cannot read this input")
        return {"length": np.array([len(b) for b in batch["data"]], dtype=np.int64)}


class Slow(Stage):
    """Takes a while to load, as a big model does."""

    def setup(self, context: StageContext) -> None:
        time.sleep(float(context.options.get("load_s", 6)))

    def __call__(self, batch: StageBatch) -> dict:
        return {"length": np.array([len(b) for b in batch["data"]], dtype=np.int64)}


class Chatty(Stage):
    """Prints and warns, as handlers and the libraries they call do."""

    def setup(self, context: StageContext) -> None:
        print("chatty: loading my vocabulary")
        warnings.warn("chatty: this option is deprecated")
        os.write(2, b"chatty: a line a C++ library writes straight to fd 2\\n")

    def __call__(self, batch: StageBatch) -> dict:
        print("chatty: called with", len(batch["data"]), "rows")
        return {"length": np.array([len(b) for b in batch["data"]], dtype=np.int64)}
'''

PAIR = '''
import torch


class Pair(torch.nn.Module):
    """A BERT-like model's two inputs, which must have the same length."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return (input_ids * attention_mask).sum(dim=1, keepdim=True)
'''


def toured_tree() -> str:
    """The tgw toured: the one this python imports (a tree's own .venv: that tree's)."""
    import tgw.broker
    return os.path.dirname(os.path.dirname(os.path.abspath(tgw.broker.__file__)))


def section(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def cut(text: str, head: int = 12, tail: int = 4) -> str:
    lines = text.rstrip("\n").splitlines()
    if len(lines) <= head + tail + 1:
        return "\n".join(lines)
    return "\n".join(lines[:head] + [f"   [... {len(lines) - head - tail} more lines ...]"] + lines[-tail:])


def run(argv: list[str] | str, cwd: str | None = None, shell: bool = False) -> subprocess.CompletedProcess:
    shown = argv if isinstance(argv, str) else " ".join(a if " " not in a else repr(a) for a in argv)
    print(f"$ {shown.replace(BIN + '/', '')}")
    t0 = time.monotonic()
    done = subprocess.run(argv, cwd=cwd, shell=shell, capture_output=True, text=True, timeout=300)
    out = (done.stdout + done.stderr).rstrip("\n")
    if out:
        print(textwrap.indent(cut(out), "  "))
    print(f"  [exit {done.returncode}, {time.monotonic() - t0:.2f} s, {len(out.splitlines())} lines]")
    return done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_store(root: str) -> dict:
    """Demo models and stages, the tour's stages, a two-input model, a TorchScript file that needs
    a custom op and a torch.export file that needs a module imported first."""
    store = os.path.join(root, "models")
    out = subprocess.run([sys.executable, "-m", "tgw.workers.demo_models", store, "--stages"],
                         capture_output=True, text=True, check=True)
    demo = json.loads(out.stdout)
    os.makedirs(os.path.join(store, "stages"))
    with open(os.path.join(store, "stages", "tour.py"), "w") as f:
        f.write(STAGES)
    with open(os.path.join(store, "tourpair.py"), "w") as f:
        f.write(PAIR)
    with open(os.path.join(store, "tourops.py"), "w") as f:
        f.write("import torch\n\nlib = torch.library.Library('tour', 'DEF')\n"
                "lib.define('scale(Tensor x) -> Tensor')\nlib.impl('scale', lambda x: x * 2, 'CPU')\n")
    with open(os.path.join(store, "tourtypes.py"), "w") as f:
        f.write("import dataclasses\nimport torch\n\n\n@dataclasses.dataclass\nclass Scores:\n"
                "    logits: torch.Tensor\n\n\ntorch.utils._pytree.register_dataclass(Scores, serialized_type_name=\"tourtypes.Scores\")\n\n\n"
                "class Head(torch.nn.Module):\n    def forward(self, x):\n        return Scores(x * 2)\n")
    build = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {store!r})
        import tourpair, tourops, tourtypes
        torch.jit.save(torch.jit.script(tourpair.Pair()), {store!r} + "/pair.pt")
        class UsesOp(torch.nn.Module):
            def forward(self, x):
                return torch.ops.tour.scale(x)
        torch.jit.save(torch.jit.script(UsesOp()), {store!r} + "/needs-op.pt")
        batch = torch.export.Dim("batch", min=1, max=8)
        ep = torch.export.export(tourtypes.Head(), (torch.randn(2, 4),), dynamic_shapes=({{0: batch}},))
        torch.export.save(ep, {store!r} + "/needs-preload.pt2")
    """)
    script = os.path.join(root, "build_tour_models.py")   # a file: torch.jit.script reads the source
    with open(script, "w") as f:
        f.write(build)
    done = subprocess.run([sys.executable, script], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"building the tour's models failed:\n{done.stderr}")
    return {"store": store, "demo": demo}


def config(root: str, store: dict, address: str, http_port: int, models: list[dict], **extra) -> str:
    demo = store["demo"]
    cfg = {"server": {"address": address, "max_inflight_per_client": 64},
           "model_roots": [store["store"]],
           "workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 16, "output_arena_mb": 8},
           "http": {"port": http_port}, "grpc": {"port": 0},
           "models": models, **extra}
    cfg["models"] = [({k: v for k, v in demo[m].items() if k not in ("base", "path", "handler", "format")}
                      | {"name": m, "versions": [{"version": "1", **({"path": demo[m]["path"]} if "path" in demo[m]
                                                                     else {"handler": demo[m]["handler"]})}]})
                     if isinstance(m, str) else m for m in models]
    path = os.path.join(root, f"tgw-{len(os.listdir(root))}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    return path


def knows_warmup_inputs() -> bool:
    """Whether this tgw lets a stage declare examples to be tried on before it serves (issue 39)."""
    from tgw.broker.config.schema_models import ModelDecl
    return "warmup_inputs" in ModelDecl.model_fields


def stage(name: str, cls: str, **kw) -> dict:
    examples = {"warmup_inputs": [{"data": "an example"}]} if knows_warmup_inputs() else {}
    return {"name": name, "versions": [{"version": "1", "handler": f"models/stages/tour.py:{cls}"}],
            "inputs": [{"name": "data", "dtype": "bytes", "shape": []}],
            "outputs": [{"name": "length", "dtype": "int64", "shape": []}], "max_batch_size": 8, **examples, **kw}


class Broker:
    """`tgw-broker start` with its stderr on a pseudo-terminal (as a user at a shell sees it) or
    on a pipe (as systemd sees it); everything it writes is kept."""

    def __init__(self, cfg: str, *extra: str, terminal: bool):
        self.argv = [BROKER, "start", "--config", cfg, *extra]
        print(f"$ {' '.join(self.argv).replace(BIN + '/', '')}   [stderr on a {'terminal' if terminal else 'pipe'}]")
        if terminal:
            self.fd, slave = pty.openpty()
        else:
            self.fd, slave = os.pipe()
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                                     start_new_session=True)
        os.close(slave)
        self.out = b""

    def read(self, wait: float = 0.0) -> str:
        while self.fd is not None and select.select([self.fd], [], [], wait)[0]:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            self.out += chunk
            wait = 0.0
        return self.out.decode(errors="replace").replace("\r\n", "\n")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.read(0.2)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.read(0.2)
        os.close(self.fd)
        self.fd = None


def ask(address: str, *argv: str) -> subprocess.CompletedProcess:
    return run([BROKER, *argv, "--address", address])


def status(address: str) -> dict:
    done = subprocess.run([BROKER, "status", "--address", address, "--json"], capture_output=True, text=True)
    try:
        return json.loads(done.stdout)
    except ValueError:
        return {}


def http(method: str, url: str, body: bytes, headers: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def tour_serving(root: str, store: dict) -> None:
    """One broker on a terminal: progress, slow loads beside fast models, the CLI, failures,
    raw bodies, a burst from one client, caller mistakes, a SIGTERM stop."""
    address = f"ipc://{root}/run/tgw.sock"
    port = free_port()
    pair = {"name": "pair", "versions": [{"version": "1", "path": os.path.join(store["store"], "pair.pt")}],
            "inputs": [{"name": "input_ids", "dtype": "int64", "shape": [-1]},
                       {"name": "attention_mask", "dtype": "int64", "shape": [-1]}],
            "outputs": [{"name": "y", "dtype": "int64", "shape": [1]}], "max_batch_size": 8}
    cfg = config(root, store, address, port,
                 ["mlp", pair, stage("length", "Length"), stage("raises", "Raises"),
                  stage("slow", "Slow", options={"load_s": 6})])

    section("3. progress: a start with a model that takes 6 s to load, beside fast ones on the same worker")
    broker = Broker(cfg, terminal=True)
    codes, first_ok, status_seen = {}, {}, None
    sock_path = address[len("ipc://"):]
    while time.monotonic() - broker.t0 < 120:
        broker.read(0.05)
        if broker.proc.poll() is not None:
            break
        if not os.path.exists(sock_path):
            continue
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import numpy as np
            from tgw.client import Client, TgwError
            with Client({address!r}) as c:
                for model, inputs in (("mlp", {{"x": np.zeros((1, 256), np.float32)}}), ("length", {{"data": [b"x"]}})):
                    try:
                        c.infer(model, inputs); print(model, "OK")
                    except TgwError as e:
                        print(model, e.code.value)
        """)], capture_output=True, text=True)
        for line in done.stdout.splitlines() or ["- no answer"]:
            model, code = line.split(" ", 1)
            if code == "OK" and model not in first_ok:
                first_ok[model] = round(time.monotonic() - broker.t0, 1)
            codes[line] = codes.get(line, 0) + 1
        st = status(address)
        slow = st.get("models", {}).get("slow")
        if slow is not None and not slow.get("ready") and (status_seen is None or slow.get("loading")):
            status_seen = {m: {k: v for k, v in e.items() if k in ("ready", "loading")}
                           for m, e in st["models"].items()}
        if status(address).get("models", {}).get("slow", {}).get("ready"):
            break
    ready_at = time.monotonic() - broker.t0
    if broker.proc.poll() is not None:
        sys.exit("the broker did not start:\n" + broker.read())
    out = broker.read(0.2)
    print(textwrap.indent(cut(out, 30, 4) or "(nothing)", "  | "))
    print(f"  [the terminal showed {len(out.splitlines())} lines in the {ready_at:.1f} s until every model was ready]")
    print(f"  mlp (a model) and length (a stage), asked again and again until slow was ready: "
          f"first answered at (s) {first_ok}; answers: {codes}")
    print(f"  status while slow loads: {json.dumps(status_seen)}")
    seen = len(broker.read())

    section("1. a broken stage version hot-swapped in")
    ask(address, "models", "load", "length", "--version", "2", "--handler",
        os.path.join(store["store"], "stages", "tour.py") + ":Broken")
    code, body = http("POST", f"http://127.0.0.1:{port}/v2/models/length/versions/2/infer",
                      json.dumps({"inputs": [{"name": "data", "datatype": "BYTES", "shape": [1],
                                              "data": ["abc"]}]}).encode(), {"Content-Type": "application/json"})
    print(f"$ curl -d '{{...data: [\"abc\"]}}' .../v2/models/length/versions/2/infer\n  [{code}] {body[:300]}")
    code, body = http("POST", f"http://127.0.0.1:{port}/v2/models/length/infer",
                      json.dumps({"inputs": [{"name": "data", "datatype": "BYTES", "shape": [1],
                                              "data": ["abc"]}]}).encode(), {"Content-Type": "application/json"})
    print(f"$ curl -d '{{...data: [\"abc\"]}}' .../v2/models/length/infer\n  [{code}] {body[:300]}")

    section("2a. a failed batch: what the broker's log says")
    code, body = http("POST", f"http://127.0.0.1:{port}/v2/models/raises/infer",
                      json.dumps({"inputs": [{"name": "data", "datatype": "BYTES", "shape": [1],
                                              "data": ["bad input"]}]}).encode(), {"Content-Type": "application/json"})
    print(f"$ curl -d '{{...data: [\"bad input\"]}}' .../v2/models/raises/infer\n  [{code}] {body[:300]}")
    time.sleep(1.0)   # the log line is written as the answer goes out; a second for it to arrive
    new = broker.read(0.5)[seen:]
    print("  broker log since:\n" + textwrap.indent(cut(new, 20, 4) or "(nothing)", "  | "))
    seen = len(broker.read())

    section("2b. a load that fails: what the CLI says, and how often the log says it")
    ask(address, "models", "load", "mlp", "--version", "9", "--path", os.path.join(store["store"], "needs-op.pt"))
    ask(address, "models", "load", "mlp", "--version", "10", "--path",
        os.path.join(store["store"], "needs-preload.pt2"))
    time.sleep(1.0)
    new = broker.read(0.5)[seen:]
    print(f"  broker log since: {len(new.splitlines())} lines, 'Unknown builtin op' "
          f"{new.count('Unknown builtin op')} times, 'needs-preload' {new.count('needs-preload')} times")
    print(textwrap.indent(cut(new, 10, 4) or "(nothing)", "  | "))
    seen = len(broker.read())

    section("5. the CLI")
    run(f"cd {store['store']} && {BROKER} models load length --version 3 --handler stages/tour.py:Length "
        f"--address {address}", shell=True)
    run([BROKER, "status", "--config", cfg])
    run([BROKER, "stats", "--help"])
    run(f"{BROKER} status --address {address} | head -1", shell=True)
    run([sys.executable, "-c", "import tgw.client as c; print([n for n in dir(c) if n.endswith('ErrorError')]); "
         "print(c.ModelExecutionErrorError)"])
    print("$ grep -rn 'tgw-broker stats' README.md docs/")
    repo = toured_tree()
    hits = subprocess.run(["grep", "-rn", "tgw-broker stats", "README.md", "docs/"], cwd=repo,
                          capture_output=True, text=True).stdout
    print(textwrap.indent(hits.rstrip() or "(none)", "  "))

    section("6. an image as the body")
    image = sorted(os.listdir(os.path.join(store["store"], "images")))[0]
    image = os.path.join(store["store"], "images", image)
    run(["curl", "-s", "-w", "\\n[%{http_code}]", "--data-binary", f"@{image}", "-H", "Content-Type: image/jpeg",
         f"http://127.0.0.1:{port}/v2/models/length/infer"])
    run(["curl", "-s", "-w", "\\n[%{http_code}]", "-T", image, f"http://127.0.0.1:{port}/v2/models/length/infer"])

    section("8. one AsyncClient, 2,000 requests at once (the tour's cap: server.max_inflight_per_client 64)")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import asyncio, collections, numpy as np
        from tgw.client import AsyncClient, TgwError
        async def main():
            async with AsyncClient({address!r}) as c:
                async def one():
                    try:
                        await c.infer("mlp", {{"x": np.zeros((1, 256), np.float32)}}); return "OK"
                    except TgwError as e:
                        return e.code.value
                codes = await asyncio.gather(*(one() for _ in range(2000)))
            print(dict(collections.Counter(codes)))
        asyncio.run(main())
    """)], capture_output=True, text=True)
    print(f"  answers by code: {done.stdout.strip() or done.stderr.strip()[-500:]}")

    section("9. a caller's mistake: input_ids of 7 tokens, attention_mask of 5")
    body = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 7], "data": [1] * 7},
                       {"name": "attention_mask", "datatype": "INT64", "shape": [1, 5], "data": [1] * 5}]}
    code, text = http("POST", f"http://127.0.0.1:{port}/v2/models/pair/infer", json.dumps(body).encode(),
                      {"Content-Type": "application/json"})
    print(f"$ curl -d '{{input_ids [1,7], attention_mask [1,5]}}' .../v2/models/pair/infer\n  [{code}] {text[:400]}")

    section("2c. a clean SIGTERM stop: what the log says")
    seen = len(broker.read())
    broker.stop()
    print(f"  exit {broker.proc.returncode}; the log's last lines:")
    print(textwrap.indent(cut(broker.read()[seen:], 10, 4) or "(nothing)", "  | "))

    section("2d. check-config on a file that cannot load without a preload, and --load")
    bad = config(root, store, address, port, [{"name": "head", "versions": [
        {"version": "1", "path": os.path.join(store["store"], "needs-preload.pt2")}],
        "inputs": [{"name": "x", "dtype": "float32", "shape": [4]}],
        "outputs": [{"name": "logits", "dtype": "float32", "shape": [4]}], "max_batch_size": 8}])
    run([BROKER, "check-config", bad])
    run([BROKER, "check-config", "--load", bad])


def tour_logs_and_socket(root: str, store: dict) -> None:
    """One broker in JSON mode on a pipe, its socket in a shared sticky folder."""
    shared = os.path.join(root, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    address = f"ipc://{shared}/x.sock"
    cfg = config(root, store, address, free_port(), ["mlp", stage("chatty", "Chatty")])

    section("4 and 7. --log-format json, stderr on a pipe; the socket in a shared sticky folder (mode 1777)")
    before = stat.S_IMODE(os.stat(shared).st_mode)
    broker = Broker(cfg, "--log-format", "json", terminal=False)
    while time.monotonic() - broker.t0 < 120 and broker.proc.poll() is None:
        broker.read(0.2)
        if status(address).get("phase") == "serving":
            break
    during = stat.S_IMODE(os.stat(shared).st_mode)
    run([sys.executable, "-c", textwrap.dedent(f"""
        from tgw.client import Client
        with Client({address!r}) as c:
            print(c.infer("chatty", {{"data": [b"abc"]}})["length"])
    """)])
    ask(address, "models", "load", "mlp", "--version", "10", "--path",
        os.path.join(store["store"], "needs-preload.pt2"))
    broker.stop()
    after = stat.S_IMODE(os.stat(shared).st_mode)
    print(f"  the shared folder's mode: before start {before:o}, while serving {during:o}, after stop {after:o}")
    lines = [ln for ln in broker.read().splitlines() if ln.strip()]
    bad = []
    for ln in lines:
        try:
            json.loads(ln)
        except ValueError:
            bad.append(ln)
    print(f"  stderr: {len(lines)} lines, {len(lines) - len(bad)} parse as JSON, {len(bad)} do not; those:")
    print(textwrap.indent(cut("\n".join(bad), 12, 3) or "(none)", "  | "))


def main() -> None:
    root = tempfile.mkdtemp(prefix="tgw-tour-")
    os.mkdir(os.path.join(root, "run"), 0o700)
    try:
        tree = toured_tree()
        print(f"# issue 39 tour, {time.strftime('%Y-%m-%d %H:%M:%S')} UTC, tgw at {tree}, commit "
              + subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                               cwd=tree).stdout.strip())
        store = build_store(root)
        tour_serving(root, store)
        tour_logs_and_socket(root, store)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
