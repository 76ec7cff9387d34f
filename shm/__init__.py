"""tgw.shm: the layer every process shares - wire contract, error codes, segments, ring, views.

Imports only the standard library, numpy and msgspec.
"""
