"""Who may talk to the broker: the shared token and the ZeroMQ CURVE keys of the front socket.

* `server.auth_token_file`: one shared token that every native request carries in its `token`
  field (docs/PROTOCOL.md §1b); compared in constant time, a mismatch is `UNAUTHENTICATED`.
* `server.curve_secret_key_file`: the broker's CURVE certificate (`tgw-broker keygen DIR`);
  with it the front socket is a CURVE server, so tcp:// traffic is encrypted and only callers
  that know the broker's public key get through the handshake. Any client key pair is accepted
  (no ZAP allow-list): the token says who may ask, CURVE keeps it and the tensors secret.

Key files are read and written by pyzmq's `zmq.auth` (the ZeroMQ certificate format).
"""
from __future__ import annotations

import hmac
import os
import shutil
import tempfile

import zmq
import zmq.auth

from tgw.broker.config.startup import StartupError


def _startup_error(message: str) -> Exception:
    return StartupError(message)


def load_token(path: str) -> str:
    """The token in `path`, surrounding whitespace stripped: printable ASCII, no inner spaces."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise _startup_error(f"cannot read the auth token file {path}: {exc.strerror}") from None
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise _startup_error(f"auth token file {path}: the token must be ASCII text") from None
    if not token:
        raise _startup_error(f"auth token file {path} is empty")
    if not all(0x21 <= ord(c) <= 0x7E for c in token):
        raise _startup_error(f"auth token file {path}: the token must be one word of printable ASCII "
                           "(no spaces, tabs, inner line breaks or control characters)")
    return token


def token_ok(expected: str | None, given: str | None) -> bool:
    """Whether a request's token matches; `expected` None means no token is configured."""
    if expected is None:
        return True
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(expected.encode(), given.encode())


def curve_server(sock: zmq.Socket, secret_file: str) -> None:
    """Make `sock` a CURVE server with the key pair in `secret_file`; call before bind."""
    if not zmq.has("curve"):
        raise _startup_error(f"server.curve_secret_key_file {secret_file}: this libzmq has no CURVE support")
    try:
        public, secret = zmq.auth.load_certificate(secret_file)
    except (OSError, ValueError) as exc:
        raise _startup_error(f"cannot read the CURVE key file {secret_file}: {exc}") from None
    if secret is None:
        raise _startup_error(f"CURVE key file {secret_file} has no secret key (is it the public .key file? "
                           "the broker needs the .key_secret file)")
    try:
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
    except zmq.ZMQError as exc:
        raise _startup_error(f"CURVE key file {secret_file} holds no valid key pair: {exc}") from None


def keygen(directory: str, name: str = "broker") -> tuple[str, str]:
    """Write NAME.key (public, 0644) and NAME.key_secret (0600) in `directory`; never overwrites.

    The pair is made in a private temporary folder and linked into place, so the secret is
    never readable by others, not even for a moment, and an existing file is never replaced."""
    if not name or os.sep in name or name.startswith("."):
        raise ValueError(f"key name must be a plain file name, got {name!r}")
    directory = os.path.abspath(directory)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    targets = [os.path.join(directory, f"{name}.key"), os.path.join(directory, f"{name}.key_secret")]
    existing = [t for t in targets if os.path.lexists(t)]
    if existing:
        raise FileExistsError(f"refusing to overwrite {', '.join(existing)}")
    tmp = tempfile.mkdtemp(prefix=".tgw-keygen-", dir=directory)   # 0700
    done: list[str] = []
    try:
        public, secret = zmq.auth.create_certificates(tmp, name)
        os.chmod(secret, 0o600)
        os.chmod(public, 0o644)
        for src, dst in zip((public, secret), targets):
            os.link(src, dst)          # fails if dst appeared meanwhile: nothing is overwritten
            done.append(dst)
    except BaseException:
        for dst in done:
            os.unlink(dst)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return targets[0], targets[1]
