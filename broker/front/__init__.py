"""The clients' side: sockets, the door, auth, callers, limits, regions, CUDA routing."""
