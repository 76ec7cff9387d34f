"""The broker's faces: adapters that speak one network protocol on the broker's loop.

A face parses its protocol's requests, calls broker/protocol/ for the semantics (KServe v2
tensors and parameters, Triton's documents, the shared-memory registry, the repository), reaches
the front door only through the `DoorPort` it is given (protocol/door.py), and writes the answer
back in its protocol's shape. Nothing in the serving core knows which face a request came from.
No face imports another: what two faces share belongs in broker/protocol/ (checked by
tests/unit/test_import_graph.py and tests/unit/test_layering.py).

http/: KServe v2 over HTTP/REST, /metrics and /v2/load (aiohttp). grpc/: KServe v2 over gRPC,
Triton's GRPCInferenceService, health and reflection (grpc.aio). openai/: OpenAI's completions
API for generators with a tokenizer; its routes are mounted on the HTTP face's port by the core.

A new face (an OpenAI-compatible API, TorchServe's, Triton's generate) goes in a package of its
own here: its adapter takes a DoorPort and its config declaration, offers start() and stop()
(answering the address it listens on), and is built beside the others by the core; semantics
it shares with another face are added to broker/protocol/, not imported from that face.
"""
