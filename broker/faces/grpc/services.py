"""The GRPCInferenceService RPCs other than inference: health, metadata, Triton's model config and
statistics, the repository extension and the shared-memory extensions.

Each answer is built from the same state and functions as the HTTP face's (protocol/repository.py,
protocol/triton_docs.py, observe/status.py): the JSON documents Triton's HTTP clients read are the
protobuf JSON mapping of these messages, so ParseDict turns them into the replies gRPC clients
read. TraceSetting and LogSettings are refused: tgw has its own (observability: in the config).
"""
from __future__ import annotations

import grpc
from google.protobuf.json_format import ParseDict

from tgw.broker.observe import status
from tgw.broker.protocol import triton_docs
from tgw.broker.protocol.repository import EXTENSIONS
from tgw.broker.protocol.triton_shm import EXTENSIONS as SHM_EXTENSIONS, FRONT_PEER, Caller, front_peer_uid, \
    tcp_peer_uid

from . import tensors
from .proto import grpc_service_pb2 as pb
from .proto import model_config_pb2 as mc



class Services:
    """`face`: the GrpcFace (its deps, repository and shm registry)."""

    def __init__(self, face):
        self.face, self.deps, self.repository = face, face.deps, face.repository

    def table(self) -> dict:
        """RPC name -> its handler, for face.py's generic handler."""
        return {"ServerLive": self.server_live, "ServerReady": self.server_ready, "ModelReady": self.model_ready,
                "ServerMetadata": self.server_metadata, "ModelMetadata": self.model_metadata,
                "ModelConfig": self.model_config, "ModelStatistics": self.model_statistics,
                "RepositoryIndex": self.repository_index, "RepositoryModelLoad": self.load,
                "RepositoryModelUnload": self.unload, "TraceSetting": self.trace_setting,
                "LogSettings": self.log_settings,
                "SystemSharedMemoryStatus": self.system_status, "SystemSharedMemoryRegister": self.system_register,
                "SystemSharedMemoryUnregister": self.system_unregister, "CudaSharedMemoryStatus": self.cuda_status,
                "CudaSharedMemoryRegister": self.cuda_register, "CudaSharedMemoryUnregister": self.cuda_unregister}

    def named(self, name: str, version: str) -> tuple[str, str | None]:
        return self.repository.named(name, version or None)

    # ---- health and metadata -----------------------------------------------------------------

    async def server_live(self, req, context):
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, req, context):
        return pb.ServerReadyResponse(ready=status.health(self.deps.view).ready)

    async def model_ready(self, req, context):
        return pb.ModelReadyResponse(ready=self.repository.ready(*self.named(req.name, req.version)))

    async def server_metadata(self, req, context):
        extensions = EXTENSIONS + (SHM_EXTENSIONS if self.face.shm is not None else [])
        # "triton": what Triton's clients and examples check, as on HTTP
        return pb.ServerMetadataResponse(name="triton", version=status.SERVER_NAME.split("/")[1], extensions=extensions)

    async def model_metadata(self, req, context):
        doc = self.repository.kserve_metadata(*self.named(req.name, req.version))
        return pb.ModelMetadataResponse(
            name=doc["name"], versions=doc["versions"], platform=doc["platform"],
            inputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in doc["inputs"]],
            outputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in doc["outputs"]])

    async def model_config(self, req, context):
        doc = self.repository.triton_config(*self.named(req.name, req.version))
        return pb.ModelConfigResponse(config=ParseDict(doc, mc.ModelConfig()))

    async def model_statistics(self, req, context):
        rows = self.repository.triton_stats(*self.named(req.name, req.version)) if req.name \
            else self.repository.all_stats()
        return ParseDict(triton_docs.statistics(rows), pb.ModelStatisticsResponse())

    async def trace_setting(self, req, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "tgw has no Triton trace settings: tracing is configured "
                            "in the broker's config (observability.tracing; docs/GRPC.md)")

    async def log_settings(self, req, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "tgw has no Triton log settings: start the broker with "
                            "--log-level and --log-format (docs/GRPC.md)")

    # ---- the repository extension ------------------------------------------------------------

    async def repository_index(self, req, context):
        rows = self.repository.index_rows(req.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(
            name=r["name"], version=r["version"], state=r["state"], reason=r["reason"] or "") for r in rows])

    async def load(self, req, context):
        await self.repository.load_model(req.model_name, tensors.parameters(req.parameters))
        return pb.RepositoryModelLoadResponse()

    async def unload(self, req, context):
        await self.repository.unload_model(req.model_name, tensors.parameters(req.parameters))
        return pb.RepositoryModelUnloadResponse()

    # ---- the shared-memory extensions --------------------------------------------------------

    async def shm(self, context):
        """The registry, when this face offers it (grpc.allow_client_shm)."""
        if self.face.shm is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Client shared memory is disabled. Set "
                                "grpc.allow_client_shm: true in the broker's config to enable (docs/GRPC.md)")
        return self.face.shm

    def caller(self, context) -> Caller:
        """Who registers, as the connection tells (the registry checks it: the broker's own uid,
        or the token where no uid can be learned). A TCP peer on this host connects from the
        address it connects to, so that is the local end looked up. On the face's Unix socket
        (front processes on: only the broker's own processes reach it) a front forwards for its
        client and tells who that is (FRONT_PEER; docs/FRONTS.md): its word is taken there only."""
        peer = context.peer() or ""
        kind, _, rest = peer.partition(":")
        uid = None
        if kind == "unix":
            told = next((v for k, v in (context.invocation_metadata() or ()) if k == FRONT_PEER), None)
            uid = front_peer_uid(told) if isinstance(told, str) else None
        elif kind in ("ipv4", "ipv6"):
            host, _, port = rest.rpartition(":")
            host = host.strip("[]")
            if port.isdigit():
                uid = tcp_peer_uid((host, int(port)), (host, self.face.port))
        return Caller(uid, self.deps.token is not None)   # with a token, every call here presented it

    async def system_status(self, req, context):
        rows = (await self.shm(context)).system_status(req.name or None)
        return pb.SystemSharedMemoryStatusResponse(regions={r["name"]: pb.SystemSharedMemoryStatusResponse.RegionStatus(
            name=r["name"], key=r["key"], offset=r["offset"], byte_size=r["byte_size"]) for r in rows})

    async def system_register(self, req, context):
        (await self.shm(context)).register_system(req.name, req.key, req.offset, req.byte_size, self.caller(context))
        return pb.SystemSharedMemoryRegisterResponse()

    async def system_unregister(self, req, context):
        (await self.shm(context)).unregister_system(req.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def cuda_status(self, req, context):
        rows = (await self.shm(context)).cuda_status(req.name or None)
        return pb.CudaSharedMemoryStatusResponse(regions={r["name"]: pb.CudaSharedMemoryStatusResponse.RegionStatus(
            name=r["name"], device_id=r["device_id"], byte_size=r["byte_size"]) for r in rows})

    async def cuda_register(self, req, context):
        (await self.shm(context)).register_cuda(req.name, req.raw_handle, req.device_id, req.byte_size,
                                                self.caller(context))
        return pb.CudaSharedMemoryRegisterResponse()

    async def cuda_unregister(self, req, context):
        (await self.shm(context)).unregister_cuda(req.name or None)
        return pb.CudaSharedMemoryUnregisterResponse()
