"""Front processes: the HTTP and gRPC faces' parsing in N processes beside the broker.

With `server.front_processes` N > 0, N processes share the faces' public ports (SO_REUSEPORT),
parse and validate requests there and hand the broker's hub compact messages (wire.py); the
broker's loop admits, batches and answers. Routes a front does not serve itself are forwarded
to the broker's own faces on private Unix sockets. 0 keeps the single loop.
"""
