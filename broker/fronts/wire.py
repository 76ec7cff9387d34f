"""What a front process and the broker's hub say to each other (the fronts socket).

One ZeroMQ socket pair per broker: the hub's ROUTER bound on `ipc://<run dir>/fronts` (the
broker's private run directory, not the client address), each front's DEALER connected to it,
with its routing id `front-<index>-<pid>`. Every multipart message starts with one kind frame.

front -> hub
  [HELLO, encode(FrontHello)]                  first message of a life; the hub answers DIRECTORY
  [INFER, encode(Infer), *tensor frames]       Infer.id is the front's own id, unique in its life;
                                               the hub calls door.infer(<the front's caller>, ...)
  [ASK, encode(msg)]                           any other client message (door.dispatch), msg.id as above;
                                               RegisterRegion/UnregisterRegion: the front's own region
                                               (region.py; the hub calls door.regions.handle)
  [WITHDRAW, encode(FrontWithdraw)]            its callers gave up: those requests leave, unrun
  [COUNT, encode(FrontCount)]                  a refusal made in the front (stats.error)
  [NOTE, encode(FrontNote)]                    a complaint (complaints.note)
  [STATS, encode(FrontStats)]                  its own figures, about once a second
  [DIRECTORY]                                  send the directory now (a model it does not know yet)

hub -> front
  [DIRECTORY, encode(Directory)]               after HELLO, on ask, and whenever it changes
  [REPLY, encode(reply msg), *frames]          what door delivered for one of its requests (id = the
                                               front's id); a generation gets several, its last final
  [DRAIN]                                      stop accepting (close the listeners), finish what is open

Why a socket of its own and not the client address: a front multiplexes thousands of callers, so
the per-client limits (max_clients, max_client_inflight) must not apply to it, and only processes
the broker started may speak here (the run directory is 0700).
"""
from __future__ import annotations

from typing import Any, Optional

import msgspec

HELLO, INFER, ASK, WITHDRAW, COUNT, NOTE, STATS = b"h", b"i", b"a", b"w", b"c", b"n", b"s"
DIRECTORY, REPLY, DRAIN = b"d", b"r", b"x"


class FrontStruct(msgspec.Struct, omit_defaults=True, gc=False):
    pass


class FrontHello(FrontStruct):
    index: int                  # 0..N-1: which front this is (a restart keeps its index)
    pid: int


class FrontWithdraw(FrontStruct):
    ids: list[int]
    reason: str                 # "client_closed", "cancelled", "deadline", "front_stopped" ...


class FrontCount(FrontStruct):
    model: Optional[str]
    code: str                   # the TgwError code's value


class FrontNote(FrontStruct):
    kind: str
    detail: str
    message: str


class FrontStats(FrontStruct):
    inflight: int               # requests sent and not yet answered
    requests: int               # requests handled in this life (all routes)
    forwarded: int              # of which forwarded to the broker's own faces
    gc: dict[str, Any] = {}     # shm/gc_watch.py's figures of this process
    region: dict[str, Any] = {}  # its input region's figures (region.py FrontRegion.as_dict); {}: none


class FrontModel(FrontStruct):
    """What a front's faces read of one model to parse and validate its requests."""
    decl: dict[str, Any]        # the ModelDecl as plain data (ModelDecl.model_dump(mode="json"))
    versions: list[str]         # loaded versions, newest last
    generator: bool = False
    default: Optional[str] = None   # ModelEntry.default: the version a request naming none gets shown
    labels: dict[str, list[str]] = {}   # ModelEntry.labels: each output's class labels as last read


class FrontPipeline(FrontStruct):
    inputs: list[dict[str, Any]]   # TensorDecl dumps
    max_batch_size: int
    version: str = ""              # Plan.version: the one version a pipeline has (versions/{v} paths)
    # output name -> [step model, that model's output name], for each output a step's model makes
    # (classification shows that model output's labels: protocol/classification.step_labels)
    sources: dict[str, list[str]] = {}


class Directory(FrontStruct):
    """The registry as the faces read it; `generation` grows with every change."""
    generation: int
    models: dict[str, FrontModel]
    pipelines: dict[str, FrontPipeline] = {}
    load_header: Optional[str] = None   # the load report's header value, refreshed by the lifecycle
    # the broker's drain notice (server.drain_notice_s): health says not ready and each HTTP
    # response closes its connection, so balancers move callers elsewhere (the load report's `draining`)
    draining: bool = False


encoder = msgspec.msgpack.Encoder()
