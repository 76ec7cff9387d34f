"""The operator's control ops and their replies (docs/PROTOCOL.md section 5.8), and the metrics scrape (5.6c).

Imported through tgw.shm.wire like every other message.
"""
from __future__ import annotations

from typing import Any, Optional

from .wire_base import IOSpec, Struct

# ---- operator control (docs/PROTOCOL.md §5.8): refused on a tcp:// listener without server.auth_token_file

class RolloutPolicy(Struct):
    """A guard on a canary or shadow version (docs/ROLLOUT.md): promoted once `promote_after_*` is
    reached with every bound kept, rolled back (unloaded) the moment one is broken. None: that
    bound (or that way to promote) is not used. Rates and p99 are judged from `min_requests` on."""
    promote_after_requests: Optional[int] = None   # answered (canary) or compared (shadow)
    promote_after_s: Optional[float] = None        # since the version took traffic or copies
    min_requests: int = 20
    max_error_rate: Optional[float] = 0.01         # failed share of its requests
    max_p99_ms: Optional[float] = None             # canary: end to end; shadow: its batches' compute
    max_p99_ratio: Optional[float] = None          # ... against the serving version's, same window
    max_abs_diff: Optional[float] = None           # shadow: any float output element, any request
    max_rel_error: Optional[float] = None          # shadow: max |diff| / max |serving| of a request
    min_top1_agreement: Optional[float] = None     # shadow: rows whose score outputs agree on the top class
    min_exact_agreement: Optional[float] = None    # shadow: rows whose integer, bool or bytes outputs are equal


class LoadVersion(Struct, tag_field="op", tag="load"):
    """Load `version` of a declared model on every worker serving it; answered once done.
    weight None: a hot swap (the new version takes every request that names no version, the
    versions that had such traffic drain and unload); a weight: added beside them with it."""
    v: int
    model: str
    version: str
    id: int = 0
    path: Optional[str] = None               # inside model_roots; None: the path the config declared
    sha256: Optional[str] = None
    weight: Optional[int] = None
    token: Optional[str] = None
    format: Optional[str] = None             # torchscript, export, aoti; None: as the file (or config) says
    # a stage's class instead of a path: "/abs/file.py:Class" inside model_roots, or "module:Class";
    # None: the handler the config declared (a model takes path, a stage handler)
    handler: Optional[str] = None
    # a shadow (docs/ROLLOUT.md): no traffic of its own; this fraction (0, 1] of the requests the
    # serving versions answer is copied to it and the outputs compared. Excludes `weight`.
    shadow: Optional[float] = None
    policy: Optional[RolloutPolicy] = None   # a guarded canary or shadow: promoted or rolled back by it


class UnloadVersion(Struct, tag_field="op", tag="unload"):
    """Drain and unload one version (or, version None, every version) of a model; answered once freed."""
    v: int
    model: str
    id: int = 0
    version: Optional[str] = None
    token: Optional[str] = None


class SetTraffic(Struct, tag_field="op", tag="traffic"):
    """Replace the weights of the versions requests that name no version are split over."""
    v: int
    model: str
    weights: dict[str, int]
    id: int = 0
    token: Optional[str] = None


class Metadata(Struct, tag_field="op", tag="metadata"):
    """One model's metadata (or every model's, model None)."""
    v: int
    id: int = 0
    model: Optional[str] = None
    token: Optional[str] = None


class Reload(Struct, tag_field="op", tag="reload"):
    """Re-read the config file and apply the difference, as SIGHUP does; answered once applied.
    With `models`: no file is read; these model entries (config-shaped dicts, a Triton load's
    config override) are served as given, replacing the models of their names, and kept by later
    reloads."""
    v: int
    id: int = 0
    token: Optional[str] = None
    models: Optional[list[dict[str, Any]]] = None


class VersionInfo(Struct):
    version: str
    path: str
    state: str                          # loading, ready, draining (being unloaded)
    weight: int = 0                     # share of the requests that name no version (of the weights' sum)
    sha256: Optional[str] = None
    workers: dict[str, str] = {}        # worker name -> loaded, loading, unloading, evicting
    bytes: int = 0                      # parameter and buffer bytes (measured at load; else the file size)
    loads: int = 0
    evictions: int = 0
    last_load_ms: float = 0.0
    format: str = "torchscript"         # what the file holds (shm/model_format.py)
    footprint: dict[str, Any] = {}      # measured memory: weights, activation_peak, by_batch, measured_on ({}: not yet)


class ModelMetadata(Struct):
    name: str
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    max_batch_size: int
    default_version: Optional[str]      # the heaviest weight's version; None while no version is loaded
    residency: str                      # always or on_demand
    versions: list[VersionInfo]


class MetadataReply(Struct, tag_field="op", tag="metadata"):
    v: int
    id: int
    models: list[ModelMetadata]


class ControlReply(Struct, tag_field="op", tag="control"):
    """A control op done: what happened, in words and figures; `model` as it is now."""
    v: int
    id: int
    message: str
    model: Optional[ModelMetadata] = None
    details: dict[str, Any] = {}


# ---- read-only, for operators (docs/PROTOCOL.md §5.6c): what GET /metrics serves, over the native socket

class Query(Struct):
    """A request that carries nothing but its version, id and token (wire.py's models, health,
    stats and status have the same three fields)."""
    v: int
    id: int = 0
    token: Optional[str] = None              # the shared auth token (server.auth_token_file)


class Scrape(Query, tag_field="op", tag="metrics"):
    """The broker's Prometheus metrics, for `tgw-broker metrics` where HTTP is off."""


class ScrapeReply(Struct, tag_field="op", tag="metrics"):
    v: int
    id: int
    text: str                                # the Prometheus text exposition format, as GET /metrics
