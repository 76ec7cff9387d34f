"""A CUDA worker's copies between its ring and its GPU, on a stream per batch in flight.

Inputs: the batch's ring block (every input of a batch lies in it, contiguous) goes to the GPU
in one host-to-device copy, and the inputs are views of that device buffer. How the ring's
memory is made page-locked is `workers.cuda_host_memory`:

* register (default): the whole segment is page-locked once at start (cudaHostRegister through
  torch's cudart bindings), so the copy is an asynchronous DMA straight from the ring: no host
  copy in the worker.
* staging: a pinned staging buffer per slot; the block is memcpy'd into it, then copied
  asynchronously (one more host copy, no registration of the ring).
* pageable: the copy from the ring as it is; CUDA stages it itself and the call blocks until it
  is done (the path before this module; kept as the benchmark's baseline).

A registration that fails (a driver or limit that refuses it) falls back to staging, with a
warning. Outputs: one device-to-host copy each, straight into the output arena (asynchronous
where the ring is registered; through the slot's pinned buffer with staging).

Each batch in flight holds a slot: its own stream (so the copy of one batch overlaps the
compute of another) and its staging buffers. A slot is free again once its batch's event has
completed, which is also when the broker is told the batch is done and frees its input block.
"""
from __future__ import annotations

import logging

import torch

from tgw.shm.ring import region_offsets

log = logging.getLogger("tgw.worker")
HOST_MEMORY = ("register", "staging", "pageable")
MAX_SLOTS = 8          # the broker holds at most server.max_inflight_batches_per_worker (<= 8) batches here


class Slot:
    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.event = torch.cuda.Event()
        self.busy = False
        self.unstage: list[tuple[torch.Tensor, torch.Tensor]] = []   # (ring, pinned) copies due at wait()
        self._staging: dict[str, torch.Tensor] = {}   # "in" / "out" -> pinned bytes, grown as needed

    def staging(self, which: str, nbytes: int) -> torch.Tensor:
        buf = self._staging.get(which)
        if buf is None or buf.numel() < nbytes:
            buf = self._staging[which] = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes]


class DeviceIO:
    def __init__(self, segment_buf, device: torch.device, host_memory: str = "register"):
        if host_memory not in HOST_MEMORY:
            raise ValueError(f"cuda_host_memory must be one of {HOST_MEMORY}, got {host_memory!r}")
        self.device, self.mode = device, host_memory
        self.ring = torch.frombuffer(segment_buf, dtype=torch.uint8)   # the whole segment, no copy
        if host_memory == "register" and not self._register():
            self.mode = "staging"
        self.slots: list[Slot] = []

    def _register(self) -> bool:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self.ring.data_ptr(), self.ring.numel(), 0)  # cudaHostRegisterDefault
        if int(err) != 0:
            log.warning("cudaHostRegister of the %d-byte ring failed (error %d): copies go through pinned "
                        "staging buffers instead", self.ring.numel(), int(err))
            return False
        log.info("ring of %d bytes page-locked (cudaHostRegister)", self.ring.numel())
        return True

    def close(self) -> None:
        """Unregister the ring and let go of it, so the segment can be unmapped."""
        if self.ring is None:
            return
        torch.cuda.synchronize(self.device)   # no copy may still read or write the ring
        if self.mode == "register":
            torch.cuda.cudart().cudaHostUnregister(self.ring.data_ptr())
        self.slots.clear()
        self.ring = None

    def slot(self) -> Slot:
        """A free slot (its stream idle once its last batch finished); a new one while none is."""
        for s in self.slots:
            if not s.busy:
                s.busy = True
                return s
        if len(self.slots) >= MAX_SLOTS:
            raise RuntimeError(f"more than {MAX_SLOTS} batches in flight on {self.device}")
        s = Slot(self.device)
        s.busy = True
        self.slots.append(s)
        return s

    def inputs(self, slot: Slot, offsets: list[int], sizes: list[int]) -> list[torch.Tensor]:
        """The ring's bytes [offsets[k], +sizes[k]) on the device, copied as one span (the batch's
        block); byte views of one device buffer, in order."""
        if not offsets:
            return []
        lo, hi = offsets[0], max(o + s for o, s in zip(offsets, sizes))
        host = self.ring[lo:hi]
        if self.mode == "staging":
            staged = slot.staging("in", hi - lo)
            staged.copy_(host)
            host = staged
        dev = torch.empty(hi - lo, dtype=torch.uint8, device=self.device)
        dev.copy_(host, non_blocking=self.mode != "pageable")
        return [dev[o - lo:o - lo + s] for o, s in zip(offsets, sizes)]

    def outputs(self, slot: Slot, outs: list[torch.Tensor], offset: int, sizes: list[int]) -> None:
        """Write `outs` (on the device) into the ring at `offset`, laid out as region_offsets(sizes)
        says: one device-to-host copy each, straight into the ring where it is registered (an
        entry of size 0 is skipped). `outs` are contiguous (Server._forward made them so): nothing
        is allocated on the device here, so an out-of-memory cannot strike while answering."""
        rels = region_offsets(sizes)
        staged = slot.staging("out", rels[-1] + sizes[-1]) if self.mode == "staging" and sizes else None
        for t, rel, size in zip(outs, rels, sizes):
            if not size:
                continue
            src = t.reshape(-1).view(torch.uint8)
            dst = self.ring[offset + rel:offset + rel + size]
            if staged is not None:   # into the ring once the copy is done (settle/wait)
                staged[rel:rel + size].copy_(src, non_blocking=True)
                slot.unstage.append((dst, staged[rel:rel + size]))
            else:
                dst.copy_(src, non_blocking=self.mode == "register")

    def settle(self, slot: Slot) -> None:
        """Block until the slot's work so far is done and its output bytes are in the ring."""
        slot.stream.synchronize()
        self._unstage(slot)

    def _unstage(self, slot: Slot) -> None:
        for dst, staged in slot.unstage:
            dst.copy_(staged)
        slot.unstage.clear()

    def record(self, slot: Slot) -> None:
        slot.event.record(slot.stream)

    def wait(self, slot: Slot) -> None:
        """Block until the slot's batch is done on the device (its output bytes in the ring), then
        free the slot."""
        slot.event.synchronize()
        self._unstage(slot)
        slot.busy = False
