"""The default arena sizes (`workers.input_arena_mb` / `output_arena_mb: auto`, broker/config/arenas.py)
end to end: a broker whose config names no sizes makes its ring exactly the auto size, and serves
concurrent requests of max_batch_size rows correctly. (The sizing rules: tests/unit/test_arenas.py.)"""
from __future__ import annotations

import os
import threading

import numpy as np

from tgw.client import Client
from tgw.shm.segment import SHM_DIR, list_segments

MIB = 1 << 20


def test_default_arenas_serve_max_batch_size_requests(model_files, make_broker):
    """A broker whose workers section names no arena sizes: the ring is exactly the auto size,
    and requests of max_batch_size rows, several at once, are all served correctly."""
    path, io = model_files["wide"]   # 16 rows -> 4 MiB of outputs: an output arena of exactly 12 MiB
    b = make_broker({"workers": {"devices": ["cpu"], "threads_per_worker": 1},
                     "models": [{"name": "wide", "versions": [{"version": "1", "path": path}],
                                 "inputs": io["inputs"], "outputs": io["outputs"], "max_batch_size": 16},
                                {"name": "mlp", "versions": [{"version": "1", "path": model_files["mlp"][0]}],
                                 "inputs": model_files["mlp"][1]["inputs"],
                                 "outputs": model_files["mlp"][1]["outputs"], "max_batch_size": 64}]})
    rings = list_segments(b.proc.pid)
    assert len(rings) == 1 and os.path.getsize(os.path.join(SHM_DIR, rings[0])) == (1 + 12) * MIB

    errors: list = []

    def caller(seed: int) -> None:
        try:
            with Client(b.address) as c:
                for k in range(4):
                    x = np.full((16, 1), seed * 10 + k, dtype=np.float32)
                    y = c.infer("wide", {"x": x}, timeout=60)["y"]
                    assert y.shape == (16, 65536) and (y == seed * 10 + k).all()
                    m = np.random.default_rng(seed).standard_normal((64, 256), dtype=np.float32)
                    assert c.infer("mlp", {"x": m}, timeout=60)["y"].shape == (64, 10)
        except Exception as exc:  # noqa: BLE001 - reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and not errors, errors
