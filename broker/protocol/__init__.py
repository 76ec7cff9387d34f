"""KServe v2 / Triton semantics that every face shares, and the port through which faces reach
the front door (faces/__init__.py says what a face is).

door.py: the DoorPort record and the caller a face hands the door; kserve.py: datatypes, tensors
(JSON and binary), parameters and the JSON-and-binary body; errors.py: refusals, Triton's error
shape and each code's gRPC status; triton_docs.py: Triton's config and statistics documents;
triton_shm.py: the registry of client shared-memory regions; repository.py: metadata, readiness
and the repository extension.

Face-neutral by rule: nothing here imports aiohttp, grpc or protobuf (tests/unit/test_layering.py
checks it). orjson is used: it is a JSON codec (numpy arrays straight out), not a face's framework.
"""
