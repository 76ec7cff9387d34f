"""tgw serving a TorchServe model store, as `tgw-bench torchserve` measures it: `tgw-broker start
--model-store DIR --models NAME=FILE.mar ...` as TorchServe is started (a broker in a child
process, stopped by PID), its TorchServe face's inference and management ports on 127.0.0.1, each
archive's batching from its model-config.yaml; ready when the broker is, /ping says Healthy and
the management API describes each model. Same shape as torchserve_server.TorchServe: .url,
.processes(), .stop().
"""
from __future__ import annotations

import json
import os
import urllib.request
from typing import Any, Optional

from tgw.bench.harness.torchserve_server import READY_TIMEOUT, free_port
from tgw.testing.child import BrokerProc, exit_record


class TgwModelStore:
    def __init__(self, work: str, store: str, models: dict[str, dict[str, Any]], workers: int):
        self.dir, self.store, self.models, self.workers = work, store, models, workers
        os.makedirs(work, exist_ok=True)
        self.inference_port, self.management_port = free_port(), free_port()
        self.broker: Optional[BrokerProc] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.inference_port}"

    @property
    def management(self) -> str:
        return f"http://127.0.0.1:{self.management_port}"

    def config(self) -> dict[str, Any]:
        """`workers` CPU workers of 1 torch thread, the store, the face's two ports, no model of its own."""
        return {"workers": {"devices": ["cpu"] * self.workers, "threads_per_worker": 1},
                "model_store": self.store,
                "torchserve": {"host": "127.0.0.1", "inference_port": self.inference_port,
                               "management_port": self.management_port}}

    def _call(self, method: str, url: str) -> Any:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=READY_TIMEOUT) as r:
            return json.loads(r.read() or b"null")

    def start(self, timeout: float = READY_TIMEOUT) -> "TgwModelStore":
        self.broker = BrokerProc(self.config(), self.dir)
        self.broker.start(timeout=timeout, args=("--model-store", self.store, "--models",
                                                 *(f"{n}={m['mar']}" for n, m in self.models.items())))
        self.broker.wait_for(self.ready, timeout, "/ping and each model described")
        return self

    def describe(self, name: str) -> Any:
        """The management API's `GET /models/{name}`."""
        return self._call("GET", f"{self.management}/models/{name}")

    def ready(self) -> bool:
        if self._call("GET", f"{self.url}/ping").get("status") != "Healthy":
            return False
        return all(self._call("GET", f"{self.management}/models/{name}")[0].get("workers") for name in self.models)

    def stats(self) -> dict[str, Any]:
        """The broker's `stats()`: measure() diffs it across a row (the batch sizes it formed)."""
        from tgw.client import Client
        with Client(self.broker.address) as c:
            return c.stats()

    def processes(self) -> list[dict[str, Any]]:
        from tgw.client import Client
        with Client(self.broker.address) as c:
            return [{"role": p["role"], "pid": p["pid"]} for p in c.stats()["processes"]]

    def stop(self) -> dict[str, Any]:
        return exit_record(self.broker) if self.broker is not None else {}
