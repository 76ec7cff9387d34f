"""tgw serving a TorchServe model store, as `tgw-bench torchserve` measures it: `tgw-broker start
--model-store DIR` (a broker in a child process, stopped by PID), its TorchServe face's inference
and management ports on 127.0.0.1, each archive registered through the management API as a
TorchServe user would (`POST /models?url=x.mar&batch_size=..&max_batch_delay=..&initial_workers=..`),
waited for until its workers are READY. Same shape as torchserve_server.TorchServe: .url,
.processes(), .stop().
"""
from __future__ import annotations

import json
import os
import urllib.parse
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
        self.broker.start(timeout=timeout, args=("--model-store", self.store))
        self.broker.wait_for(lambda: self._call("GET", f"{self.url}/ping").get("status") == "Healthy",
                             timeout, "/ping")
        for name, m in self.models.items():
            q = urllib.parse.urlencode({"url": m["mar"], "model_name": name, "batch_size": m.get("batch_size", 1),
                                        "max_batch_delay": m.get("max_batch_delay_ms", 0),
                                        "initial_workers": self.workers, "synchronous": "true"})
            self._call("POST", f"{self.management}/models?{q}")
        return self

    def processes(self) -> list[dict[str, Any]]:
        from tgw.client import Client
        with Client(self.broker.address) as c:
            return [{"role": p["role"], "pid": p["pid"]} for p in c.stats()["processes"]]

    def stop(self) -> dict[str, Any]:
        return exit_record(self.broker) if self.broker is not None else {}
