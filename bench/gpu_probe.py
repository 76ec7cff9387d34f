"""gpu_bench.py's CUDA side, each function run in a fresh interpreter (in_subprocess), so torch
and CUDA stay out of the harness and its load generator: the device probe and the host -> device
copies from pageable, registered and staged memory."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np


def in_subprocess(function: str, *args: Any, timeout: float = 300) -> Any:
    """function(*args) of this module run by a fresh interpreter; its JSON result."""
    code = ("import json, sys; from tgw.bench import gpu_probe; "
            f"print(json.dumps(gpu_probe.{function}(*json.loads(sys.argv[1]))))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{function} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def probe(device: str) -> dict[str, Any]:
    """torch's version, the CUDA it was built for, and whether `device` (cuda:N) exists."""
    import torch
    index = (torch.device(device).index or 0) if device.startswith("cuda") else None
    there = torch.cuda.is_available() and index is not None and index < torch.cuda.device_count()
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "device_there": there, "name": torch.cuda.get_device_name(index) if there else None}


def _timed(op: Callable[[], Any], iters: int, nbytes: int, device: str) -> dict[str, float]:
    """op() timed by CUDA events around it on the current stream (median and p99 over `iters`),
    and by the wall clock up to the end event's completion."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        op()
    torch.cuda.synchronize(device)
    us, wall = np.empty(iters), np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter()
        start.record()
        op()
        end.record()
        end.synchronize()
        wall[i] = (time.perf_counter() - t0) * 1e6
        us[i] = start.elapsed_time(end) * 1e3
    med = float(np.median(us))
    return {"us_per_batch": med, "gb_per_s": nbytes / med / 1e3, "p99_us": float(np.percentile(us, 99)),
            "wall_us": float(np.median(wall))}


def copy_rows(device: str, nbytes: int, iters: int) -> dict[str, Any]:
    """One max batch's input bytes copied host -> device from (i) pageable memory, a view of a POSIX
    shared-memory mapping as the worker's ring is; (ii) the same mapping page-locked with
    cudaHostRegister (unregistered after); (iii) a memcpy into a pinned staging tensor, then the
    copy. Each row: {us_per_batch, gb_per_s, p99_us, wall_us} or {"error"}; "fastest" names one."""
    import mmap

    import torch
    from tgw.shm.segment import Segment, new_name
    torch.cuda.set_device(device)
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    seg = Segment.create(new_name("gpubench"), size)
    try:
        out = {"bytes": nbytes, **_copies(seg.buf, size, nbytes, iters, device)}   # its views are gone then
    finally:
        try:
            seg.close()
        except BufferError:   # a view is still alive; the mapping goes with the process
            pass
        seg.unlink()
    rows = {k: out[k] for k in ("pageable", "registered", "staging") if "us_per_batch" in out.get(k, {})}
    out["fastest"] = min(rows, key=lambda k: rows[k]["us_per_batch"]) if rows else None
    return out


def _copies(buf: memoryview, size: int, nbytes: int, iters: int, device: str) -> dict[str, Any]:
    import torch
    out: dict[str, Any] = {}
    src = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))   # every page touched
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out["pageable"] = _timed(lambda: dst.copy_(src, non_blocking=True), iters, nbytes, device)
    try:
        cudart = torch.cuda.cudart()
        rc = int(cudart.cudaHostRegister(src.data_ptr(), size, 0))   # 0: cudaHostRegisterDefault
    except Exception as exc:  # noqa: BLE001 - reported in the row
        rc, out["registered"] = None, {"error": f"cudaHostRegister unavailable: {type(exc).__name__}: {exc}"}
    if rc == 0:
        try:
            out["registered"] = _timed(lambda: dst.copy_(src, non_blocking=True), iters, nbytes, device)
        finally:
            out["unregister_rc"] = int(cudart.cudaHostUnregister(src.data_ptr()))
    elif rc is not None:
        out["registered"] = {"error": f"cudaHostRegister returned {rc}"}
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def staged() -> None:
        pinned.copy_(src)
        dst.copy_(pinned, non_blocking=True)
    out["staging"] = _timed(staged, iters, nbytes, device)
    # its two parts apart: the memcpy into the staging tensor, and the copy from pinned memory
    out["staging"]["h2d_us"] = _timed(lambda: dst.copy_(pinned, non_blocking=True), iters, nbytes,
                                      device)["us_per_batch"]
    t0 = time.perf_counter()
    for _ in range(iters):
        pinned.copy_(src)
    out["staging"]["memcpy_us"] = (time.perf_counter() - t0) / iters * 1e6
    return out


# ---- the rows ---------------------------------------------------------------------------------------
