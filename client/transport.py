"""What Client, AsyncClient and streams share on the socket: a request's parts going out, a
reply's coming in, how long to wait for it, and the goodbye before closing."""
from __future__ import annotations

import zmq

from tgw.shm.errors import Code, fail
from tgw.shm.wire import PROTOCOL_VERSION, DecodeError, Goodbye, encode, reply_decoder

from .connection import Link
from .tensors import ZERO_COPY_MIN

# plain ints: pyzmq's enum flags cost an enum operation per use, and its send_multipart,
# recv_multipart and Socket.poll helpers several (Python-level option lookups, a Poller per
# call), which is most of what this client spends per call besides the socket itself
SNDMORE, POLLIN, ENOTSUP = int(zmq.SNDMORE), int(zmq.POLLIN), int(zmq.ENOTSUP)
NOBLOCK, EVENTS, RCVMORE = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.RCVMORE)
# the Cython send itself: zmq.Socket.send is a Python layer over it for options this client never uses
RAW_SEND = zmq.backend.Socket.send
REPLY_GRACE_S = 0.1  # past the timeout, for the broker's own DEADLINE_EXCEEDED (its sweep runs every 50 ms)
NO_TIMEOUT_WAIT_S = 600.0  # a request without timeout still stops waiting for a vanished broker
GOODBYE_LINGER_MS = 100  # how long close() lets the goodbye go out


def reply_wait(timeout: float | None) -> float:
    """How long to wait for the reply to a request with this timeout (seconds; None: none)."""
    return NO_TIMEOUT_WAIT_S if timeout is None else timeout + REPLY_GRACE_S


def send_request(sock: zmq.Socket, header: bytes, frames: list, nbytes: int | None = None) -> None:
    """Send the encoded header and its tensor frames (`nbytes` in all, when the caller knows) as
    one multipart message. Raises zmq.Again, with nothing queued, while no connection is up
    (ZMQ_IMMEDIATE): only the first part can fail so, as the later ones block instead."""
    copy = (sum(len(f) for f in frames) if nbytes is None else nbytes) < ZERO_COPY_MIN
    send = RAW_SEND
    if frames:
        send(sock, header, SNDMORE | NOBLOCK, copy)
        for f in frames[:-1]:
            send(sock, f, SNDMORE, copy)
        send(sock, frames[-1], 0, copy)
    else:
        send(sock, header, NOBLOCK, copy)


def read_reply(sock: zmq.Socket):
    """One reply waiting on `sock`: its decoded header and its tensor frames."""
    # the header as bytes: a Frame costs an object and a GIL release more (its close), and a GIL
    # release is a thread switch when other calling threads wait for it
    header = sock.recv()
    parts = []
    more = sock.getsockopt(RCVMORE)
    while more:
        frame = sock.recv(copy=False)   # pyzmq sets each frame's `more` as it receives it
        parts.append(frame)
        more = frame.more
    try:
        return reply_decoder.decode(header), parts
    except DecodeError as exc:
        raise fail(Code.INTERNAL, f"undecodable reply from broker: {exc}") from None


def check_size(declared: int, sent: int, limit: int) -> None:
    """The broker's size rule, applied before sending (`declared`: the tensors' raw bytes, `sent`:
    the bytes of their frames): a frame over it would not be read at all (the broker drops such
    a connection unread), so the caller would only see a timeout."""
    if max(declared, sent) > limit:
        raise fail(Code.PAYLOAD_TOO_LARGE, f"request carries {max(declared, sent)} bytes of tensors; the "
                   f"broker's limit is {limit} (server.max_request_bytes)", limit=limit)


def say_goodbye(link: Link, token: str | None) -> int:
    """Tell the broker this client is leaving (it drops what the client still has queued), best
    effort: a broker that is gone needs none. Returns the linger to close the link with."""
    link.events()
    if not link.up:
        return 0
    try:
        link.sock.send(encode(Goodbye(v=PROTOCOL_VERSION, token=token)), NOBLOCK)
    except zmq.ZMQError:
        pass
    return GOODBYE_LINGER_MS
