"""StartupError: the broker cannot start as configured (a bad socket, key, device or exporter)."""


class StartupError(RuntimeError):
    """Start-up cannot go on; the message says why (no traceback is printed)."""
