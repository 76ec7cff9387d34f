"""The broker's CURVE public key as a caller names it: the one rule, shared by the client
library and the `tgw-broker` verbs (broker/cli/ask.py), which may not import each other.

zmq is imported inside the function: tgw.shm loads no zmq at import (tests/unit/test_layering.py).
"""
from __future__ import annotations

import os

Z85_KEY_CHARS = 40   # a 32-byte CURVE key in z85 text


class BadServerKey(ValueError):
    """The value names no CURVE public key; the message says what was wrong."""


def server_public_key(value: str | bytes) -> bytes:
    """A broker's CURVE public key (z85 bytes) from its z85 text (40 characters) or its `.key`
    certificate file (public or secret: both hold the public key); raises BadServerKey."""
    import zmq.auth
    from zmq.utils import z85

    # "replace": undecodable bytes fail the checks below with the message, not a UnicodeDecodeError
    text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    if os.path.isfile(text):
        try:
            return zmq.auth.load_certificate(text)[0]
        except (OSError, ValueError) as exc:
            raise BadServerKey(f"cannot read the server key file {text}: {exc}") from None
    text = text.strip()
    if len(text) == Z85_KEY_CHARS:
        try:
            z85.decode(text)
            return text.encode()
        except (ValueError, KeyError, IndexError):   # z85.decode's ways of saying "not z85"
            pass
    raise BadServerKey(f"server key {text[:60]!r} is neither a 40-character z85 CURVE public key nor an "
                       "existing certificate file (the broker's .key file from `tgw-broker keygen`)")
