"""One model's response cache: answers to inputs seen before, given again by the broker without a
worker (docs/CACHE.md).

The key is a hash (sha256 or blake2b: NEW_HASH) of the model, the version that answers (the
traffic split's pick when the request named none), the outputs asked for, and each input in
declared order: its name, dtype, shape and exact bytes as the ring would take them (lz4
inflated, a reduced wire precision widened). So two versions never share an entry, and an
answer is only given for the very bytes it was computed from. The value is each output's dtype,
shape and bytes, copied out of the output arena (its blocks are released after the reply).

Bounded by `entries` and by `max_bytes` (the outputs' bytes plus 16 per key): the least recently
used go first. An entry older than `ttl_s` is dropped when it is looked up. Versions that stop
serving have their entries dropped at once (the registry calls `drop` and `clear`); a computed
answer looked up before such a drop is not stored (`epoch`), so a retired version's answers
cannot come back. The broker's loop is the only thread here: no lock.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from functools import partial
from hashlib import blake2b, sha256
from typing import Iterable, NamedTuple

from tgw.shm.wire import Infer

from tgw.broker.config.schema import CacheDecl
from tgw.broker.state.pending import Pending

KEY_BYTES = 16   # bytes of each key: collisions are out of reach at any number of entries


LAYOUTS_MAX = 1024   # distinct output layouts shared between entries; past it the table starts over


class Held(NamedTuple):
    """An output as the answer path reads it (in place of the ring's BlockTensor): dtype and shape."""
    dtype: str
    shape: tuple


class Entry:
    """One kept answer: its outputs' bytes in one object, and where each lies in it (`layout`:
    (name, Held, start, end) per output, one tuple shared by every entry of that layout), so
    an entry costs a few small objects, whatever its outputs; the views are made per hit."""
    __slots__ = ("version", "data", "layout", "expires")

    def __init__(self, version: str, data: bytes, layout: tuple, expires: float | None):
        self.version, self.data, self.layout, self.expires = version, data, layout, expires


def _sha_instructions() -> bool:
    """Whether the CPU hashes SHA-256 in hardware (x86 `sha_ni`, ARM `sha2`), as OpenSSL then does."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return "sha_ni" in flags or "sha2" in flags


# every byte of every input is hashed, so the hash's speed is the cache's main cost on large inputs:
# with SHA instructions sha256 takes 29 us for 48 KiB where blake2b takes 53 (docs/CACHE.md); both
# cut to 16 bytes, out of reach of collisions (a collision would hand one caller another's answer)
NEW_HASH = sha256 if _sha_instructions() else partial(blake2b, digest_size=KEY_BYTES)


def response_key(p: Pending, msg: Infer, order: list[int]) -> bytes:
    """The hash an answer to `p` is kept under (`order[k]`: the request's index of declared input k;
    p.tensors are the inputs' bytes in declared order)."""
    h = NEW_HASH(f"{p.model}\0{p.version}\0{','.join(p.outputs)}".encode())
    for data, i in zip(p.tensors, order):
        t = msg.inputs[i]
        h.update(f"\0{t.name}\0{t.dtype}\0{t.shape}\0{len(data)}\0".encode())   # lengths: no two inputs run together
        h.update(data)
    return h.digest()[:KEY_BYTES]


def by_handle(msg: Infer) -> bool:
    """Whether the request names CUDA tensors: their bytes live on a GPU the broker never reads."""
    if msg.output_cuda:
        return True
    for t in msg.inputs:   # a plain loop: no generator per request
        if t.cuda is not None:
            return True
    return False


class ResponseCache:
    def __init__(self, decl: CacheDecl):
        self.max_entries, self.max_bytes, self.ttl_s = decl.entries, decl.max_bytes, decl.ttl_s
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()   # least recently used first
        self.nbytes = 0
        self.epoch = 0               # bumped by every drop: a lookup made before one stores nothing
        self.hits = self.misses = self.bypassed = 0
        self.evictions: Counter = Counter()   # reason (entries, bytes, expired, invalidated) -> entries
        self.layouts: dict[tuple, tuple] = {}  # each layout once, shared by the entries that have it

    def lookup(self, p: Pending, msg: Infer, order: list[int], now: float) -> bool:
        """Whether a kept answer answers `p` (then p.cache_hit holds its outputs, as the answer
        path takes a computed one's); on a miss, p.cache_miss says where its answer is to be kept."""
        if by_handle(msg):
            self.bypassed += 1
            return False
        key = response_key(p, msg, order)
        entry = self.entries.get(key)
        if entry is not None and entry.expires is not None and now >= entry.expires:
            self._evict(key, "expired")
            entry = None
        if entry is None:
            self.misses += 1
            p.cache_miss = (self, key, self.epoch)
            return False
        self.entries.move_to_end(key)
        self.hits += 1
        data = memoryview(entry.data)
        p.cache_hit = {name: (held, data[start:end]) for name, held, start, end in entry.layout}
        return True

    def store(self, key: bytes, epoch: int, p: Pending, views: dict, now: float) -> None:
        """Keep `p`'s computed answer (`views`: name -> (tensor, its rows' bytes in the output
        arena)) unless a drop came since its lookup, or it alone exceeds max_bytes."""
        if epoch != self.epoch or key in self.entries:   # a twin computed alongside is kept already
            return
        layout, parts, at = [], [], 0
        for name in p.outputs:
            t, raw = views[name]
            layout.append((name, Held(t.dtype, (p.rows, *t.shape[1:])), at, at + raw.nbytes))
            parts.append(raw)
            at += raw.nbytes
        nbytes = at + KEY_BYTES
        if nbytes > self.max_bytes:
            return
        entries = self.entries
        while len(entries) >= self.max_entries:
            self._evict(next(iter(entries)), "entries")
        while self.nbytes + nbytes > self.max_bytes:
            self._evict(next(iter(entries)), "bytes")
        entries[key] = Entry(p.version, b"".join(parts), self._shared(tuple(layout)),   # the arena's block
                             None if self.ttl_s is None else now + self.ttl_s)          # goes after the reply
        self.nbytes += nbytes

    def _shared(self, layout: tuple) -> tuple:
        if len(self.layouts) >= LAYOUTS_MAX and layout not in self.layouts:
            self.layouts.clear()
        return self.layouts.setdefault(layout, layout)

    def _evict(self, key: bytes, reason: str) -> None:
        self.nbytes -= len(self.entries.pop(key).data) + KEY_BYTES
        self.evictions[reason] += 1

    def drop(self, versions: Iterable[str]) -> None:
        """These versions serve no more (retired, unloaded, dropped): their answers go now."""
        gone = set(versions)
        self.epoch += 1
        for key in [k for k, e in self.entries.items() if e.version in gone]:
            self._evict(key, "invalidated")

    def clear(self) -> None:
        """The model is removed or its cache redeclared: every answer goes now."""
        self.epoch += 1
        self.evictions["invalidated"] += len(self.entries)
        self.entries.clear()
        self.nbytes = 0

    def as_dict(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.nbytes, "max_entries": self.max_entries,
                "max_bytes": self.max_bytes, "ttl_s": self.ttl_s, "hits": self.hits, "misses": self.misses,
                "bypassed": self.bypassed, "evictions": dict(self.evictions)}
