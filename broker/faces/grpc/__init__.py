"""The KServe v2 gRPC face: inference.GRPCInferenceService, grpc.health.v1 and reflection."""
