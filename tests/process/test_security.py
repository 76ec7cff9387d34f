"""Who may talk to the broker: the shared token (server.auth_token_file) and CURVE on tcp://
(server.curve_secret_key_file). broker/front/auth.py in isolation, then real brokers, real sockets.

Waits are on observable conditions: a reply, a process exit, or a ZeroMQ monitor event (a
CURVE handshake that fails is reported as HANDSHAKE_FAILED_*, so "nothing gets through" is
checked after the handshake is known to have failed, not after a sleep).
"""
from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from conftest import base_config
from tgw.testing.child import BrokerProc
from tgw.broker.front.auth import curve_server, keygen, load_token, token_ok
from tgw.broker.cli.main import main as cli_main
from tgw.broker.cli.ask import Unreachable, ask
from tgw.broker.config.startup import StartupError
from tgw.client import Client, ConnectError, UnauthenticatedError
from tgw.client.settings import server_public_key
from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import (PROTOCOL_VERSION, ErrorReply, Health, HealthReply, Hello, Infer, ListModels, Snapshot,
                          Stats, Status, TensorMeta, encode, reply_decoder, request_decoder)

TOKEN = "s3cr3t-Token_0123456789abcdef"
X = np.zeros((2, 256), np.float32)   # the demo mlp: x float32 [256] -> y float32 [10]
WAIT_S = 30.0                        # bound of every wait for something that must come
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@pytest.fixture(autouse=True)
def no_env_credentials(monkeypatch):
    """The client's defaults come from the environment: each test says what it uses."""
    monkeypatch.delenv("TGW_TOKEN", raising=False)
    monkeypatch.delenv("TGW_SERVER_KEY", raising=False)


def write_secret(path: str, text: str) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tgw_broker(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("TGW_TOKEN", "TGW_SERVER_KEY")}
    return subprocess.run([sys.executable, "-m", "tgw.broker", *args], capture_output=True, text=True,
                          timeout=120, env={**clean, **(env or {})})


def ready(address: str, **kw) -> bool:
    with Client(address, connect_timeout=1.0, **kw) as c:
        return bool(c.health()["ready"])


def start_broker(cfg: dict, workdir: str, address: str | None = None, **client_kw) -> BrokerProc:
    b = BrokerProc(cfg, workdir)
    if address:
        b.address = address
    b.start(wait=False)
    try:
        b.wait_for(lambda: ready(b.address, **client_kw), 90, f"ready at {b.address}")
    except BaseException:
        b.stop()
        raise
    return b


def stop_broker(b: BrokerProc, workdir: str) -> None:
    code = b.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    assert code == 0, f"broker exited {code} on SIGTERM:\n{b.output()}"


def raw_request(address: str, msg, *frames: bytes, server_key: bytes | None = None):
    """One request on a fresh DEALER (CURVE with `server_key`); its decoded reply."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        if server_key is not None:
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
            sock.curve_serverkey = server_key
        sock.connect(address)
        sock.send_multipart([encode(msg), *frames])
        assert sock.poll(int(WAIT_S * 1000)), f"no reply to {type(msg).__name__} within {WAIT_S:g}s"
        return reply_decoder.decode(sock.recv_multipart()[0])
    finally:
        sock.close()
        ctx.term()


def handshake_outcome(address: str, setup, answers: bool = True) -> tuple[int, bool]:
    """Connect a DEALER set up by `setup`, send a hello, and wait for the ZeroMQ handshake's
    outcome (a monitor event); returns (event, whether a reply arrived). After a successful
    handshake with a peer that `answers`, the reply is waited for (bounded)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    setup(sock)
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | sum(HANDSHAKE_FAILED))
    try:
        sock.connect(address)
        sock.send(encode(Hello(v=PROTOCOL_VERSION, id=1, client="test_security")))
        assert mon.poll(int(WAIT_S * 1000)), "no handshake outcome"
        event = recv_monitor_message(mon)["event"]
        # the handshake is over: after a failure no message can pass, so a short look is enough
        wait_ms = int(WAIT_S * 1000) if answers and event == zmq.EVENT_HANDSHAKE_SUCCEEDED else 100
        replied = bool(sock.poll(wait_ms))
        return event, replied
    finally:
        sock.disable_monitor()
        mon.close()
        sock.close()
        ctx.term()


# ---- broker/front/auth.py ------------------------------------------------------------------------

def test_token_ok():
    assert token_ok(None, None) and token_ok(None, "anything")      # no token configured
    assert token_ok(TOKEN, TOKEN)
    for given in (None, "", "wrong", TOKEN[:-1], TOKEN + "x", TOKEN.upper(), "tökén", 42):
        assert not token_ok(TOKEN, given), given


def test_load_token(tmp_path):
    assert load_token(write_secret(str(tmp_path / "ok"), f"  {TOKEN}\n")) == TOKEN
    for name, content, why in (("empty", "", "empty"), ("blank", " \n\t\n", "empty"),
                               ("spaced", "two words\n", "printable ASCII"),
                               ("lines", "one\ntwo\n", "printable ASCII"),
                               ("control", "a\x07b", "printable ASCII")):
        path = write_secret(str(tmp_path / name), content)
        with pytest.raises(StartupError, match=why) as err:
            load_token(path)
        assert path in str(err.value)
    path = str(tmp_path / "utf8")
    with open(path, "wb") as f:
        f.write("tökén".encode())
    with pytest.raises(StartupError, match="ASCII") as err:
        load_token(path)
    assert path in str(err.value)
    with pytest.raises(StartupError, match="cannot read") as err:
        load_token(str(tmp_path / "missing"))
    assert str(tmp_path / "missing") in str(err.value)


def test_keygen_writes_a_private_secret_and_never_overwrites(tmp_path):
    keys = str(tmp_path / "keys")
    public, secret = keygen(keys)
    assert (public, secret) == (os.path.join(keys, "broker.key"), os.path.join(keys, "broker.key_secret"))
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(keys).st_mode) & 0o077 == 0
    pub, sec = zmq.auth.load_certificate(secret)
    assert sec is not None and zmq.auth.load_certificate(public) == (pub, None)
    before = [open(p, "rb").read() for p in (public, secret)]
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        keygen(keys)
    assert [open(p, "rb").read() for p in (public, secret)] == before
    os.unlink(public)                       # one of the pair left: still refused, nothing written
    with pytest.raises(FileExistsError, match="broker.key_secret"):
        keygen(keys)
    assert not os.path.exists(public)
    other = keygen(keys, name="other")
    assert zmq.auth.load_certificate(other[0])[0] != pub
    assert sorted(os.listdir(keys)) == ["broker.key_secret", "other.key", "other.key_secret"]  # no temp left
    with pytest.raises(ValueError):
        keygen(keys, name="../escape")


def test_keygen_cli(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        cli_main(["keygen", str(tmp_path / "k"), "--name", "edge"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    public, secret = str(tmp_path / "k" / "edge.key"), str(tmp_path / "k" / "edge.key_secret")
    assert public in out and secret in out
    assert "curve_secret_key_file" in out and "TGW_SERVER_KEY" in out and "server_key=" in out
    assert zmq.auth.load_certificate(public)[0].decode() in out
    with pytest.raises(SystemExit) as done:
        cli_main(["keygen", str(tmp_path / "k"), "--name", "edge"])
    assert done.value.code == 1
    assert "refusing to overwrite" in capsys.readouterr().err


def test_curve_server_serves_only_curve_clients_with_its_key(tmp_path):
    public, secret = keygen(str(tmp_path))
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    try:
        curve_server(router, secret)
        assert router.curve_server
        address = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
        server_key = zmq.auth.load_certificate(public)[0]

        def client(sock):
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
            sock.curve_serverkey = server_key
        assert handshake_outcome(address, client, answers=False)[0] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        assert router.poll(int(WAIT_S * 1000))
        _, header = router.recv_multipart()
        assert isinstance(request_decoder.decode(header), Hello)
        assert handshake_outcome(address, lambda s: None, answers=False)[0] in HANDSHAKE_FAILED
        assert not router.poll(0)
    finally:
        router.close()
        ctx.term()


def test_curve_server_refuses_unusable_key_files(tmp_path):
    public, secret = keygen(str(tmp_path))
    junk = write_secret(str(tmp_path / "junk"), "not a certificate\n")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        for path, why in ((public, "no secret key"), (str(tmp_path / "missing"), "cannot read"),
                          (junk, "cannot read")):
            with pytest.raises(StartupError, match=why) as err:
                curve_server(sock, path)
            assert path in str(err.value)
        assert not sock.curve_server
    finally:
        sock.close(linger=0)
        ctx.term()


# ---- the client's and the CLI's checks, before any socket ------------------------------------

def test_tcp_needs_a_server_key():
    with pytest.raises(ConnectError, match="TGW_SERVER_KEY"):
        Client("tcp://127.0.0.1:9")
    with pytest.raises(Unreachable, match="TGW_SERVER_KEY"):
        ask("tcp://127.0.0.1:9", Status(v=PROTOCOL_VERSION))
    r = tgw_broker("status", "--address", "tcp://127.0.0.1:9")
    assert r.returncode == 1 and "TGW_SERVER_KEY" in r.stderr


def test_server_key_forms(tmp_path):
    public, secret = keygen(str(tmp_path))
    key = zmq.auth.load_certificate(public)[0]
    assert server_public_key(public) == server_public_key(key.decode()) == server_public_key(key) == key
    assert server_public_key(secret) == key          # a secret certificate holds the public key too
    for bad in ("short", "x" * 40 + "y", str(tmp_path / "nope.key"), "~" * 40):
        with pytest.raises(ConnectError, match="server key"):
            server_public_key(bad)


# ---- a broker with a token -------------------------------------------------------------------

@pytest.fixture(scope="module")
def token_broker(model_files):
    d = tempfile.mkdtemp(prefix="tgws-", dir="/tmp")
    token_file = write_secret(os.path.join(d, "token"), TOKEN + "\n")
    b = start_broker(base_config(model_files, "mlp", server={"auth_token_file": token_file}), d, token=TOKEN)
    b.token_file = token_file
    yield b
    stop_broker(b, d)


def test_connect_without_or_with_a_wrong_token_is_refused(token_broker, monkeypatch):
    for token in (None, "wrong", TOKEN[:-1], TOKEN + "0"):
        with pytest.raises(UnauthenticatedError) as err:   # at connect: the hello is checked
            Client(token_broker.address, token=token)
        assert err.value.code == Code.UNAUTHENTICATED and not err.value.retryable
    monkeypatch.setenv("TGW_TOKEN", "wrong")
    with pytest.raises(UnauthenticatedError):
        Client(token_broker.address)


def test_the_right_token_is_served(token_broker, monkeypatch):
    with Client(token_broker.address, token=TOKEN) as c:
        assert c.infer("mlp", {"x": X})["y"].shape == (2, 10)
        assert [m["name"] for m in c.models()] == ["mlp"]
        assert c.health()["ready"] and c.status()["phase"] == "serving" and "mlp" in c.stats()["models"]
    monkeypatch.setenv("TGW_TOKEN", TOKEN)                  # the default, from the environment
    with Client(token_broker.address) as c:
        assert c.infer("mlp", {"x": X})["y"].shape == (2, 10)


@pytest.mark.parametrize("op", ["hello", "infer", "models", "health", "stats", "status", "snapshot"])
def test_every_request_is_checked_not_only_the_hello(token_broker, op):
    frames = [X.tobytes()] if op == "infer" else []
    make = {"hello": lambda **t: Hello(v=PROTOCOL_VERSION, id=7, **t),
            "infer": lambda **t: Infer(v=PROTOCOL_VERSION, id=7, model="mlp",
                                       inputs=[TensorMeta(name="x", dtype="float32", shape=[2, 256])], **t),
            "models": lambda **t: ListModels(v=PROTOCOL_VERSION, id=7, **t),
            "health": lambda **t: Health(v=PROTOCOL_VERSION, id=7, **t),
            "stats": lambda **t: Stats(v=PROTOCOL_VERSION, id=7, **t),
            "status": lambda **t: Status(v=PROTOCOL_VERSION, id=7, **t),
            "snapshot": lambda **t: Snapshot(v=PROTOCOL_VERSION, id=7, **t)}[op]
    for kw in ({}, {"token": "wrong"}, {"token": ""}):
        reply = raw_request(token_broker.address, make(**kw), *frames)
        assert isinstance(reply, ErrorReply) and reply.error.code == "UNAUTHENTICATED", (kw, reply)
        assert reply.id == 7
    if op not in ("snapshot",):                                # with it, the request is served
        reply = raw_request(token_broker.address, make(token=TOKEN), *frames)
        assert not isinstance(reply, ErrorReply), reply
    assert isinstance(raw_request(token_broker.address, Health(v=PROTOCOL_VERSION, id=8, token=TOKEN)),
                      HealthReply)                             # and the broker serves on


def test_status_cli_with_token(token_broker):
    addr = token_broker.address
    r = tgw_broker("status", "--address", addr, "--token-file", token_broker.token_file)
    assert r.returncode == 0, r.stderr
    assert f"{addr}: serving" in r.stdout and "mlp" in r.stdout
    r = tgw_broker("status", "--address", addr, "--json", env={"TGW_TOKEN": TOKEN})
    assert r.returncode == 0 and '"phase": "serving"' in r.stdout, r.stderr
    r = tgw_broker("status", "--address", addr)
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr
    r = tgw_broker("status", "--address", addr, "--token-file", os.path.join(token_broker.dir, "missing"))
    assert r.returncode == 1 and "missing" in r.stderr


# ---- a broker on tcp:// with CURVE -----------------------------------------------------------

@pytest.fixture(scope="module")
def curve_broker(model_files):
    d = tempfile.mkdtemp(prefix="tgws-", dir="/tmp")
    public, secret = keygen(os.path.join(d, "keys"))
    address = f"tcp://127.0.0.1:{free_port()}"
    cfg = base_config(model_files, "mlp", server={"address": address,
                                                  "curve_secret_key_file": "keys/broker.key_secret"})
    b = start_broker(cfg, d, address, server_key=public)
    b.public_file, b.public_key = public, zmq.auth.load_certificate(public)[0]
    yield b
    stop_broker(b, d)


def test_curve_client_with_the_server_key_is_served(curve_broker, monkeypatch):
    for key in (curve_broker.public_file, curve_broker.public_key.decode()):
        with Client(curve_broker.address, server_key=key) as c:
            assert c.infer("mlp", {"x": X}, compress=True)["y"].shape == (2, 10)
    monkeypatch.setenv("TGW_SERVER_KEY", curve_broker.public_file)
    with Client(curve_broker.address) as c:
        assert c.health()["ready"]


def test_wrong_server_key_is_not_served(curve_broker, tmp_path):
    other = zmq.auth.load_certificate(keygen(str(tmp_path))[0])[0]
    with pytest.raises(ConnectError, match="no tgw broker answered"):
        Client(curve_broker.address, server_key=other, connect_timeout=0.5)

    def wrong_key(sock):
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = other
    event, replied = handshake_outcome(curve_broker.address, wrong_key)
    assert event in HANDSHAKE_FAILED and not replied


def test_plain_dealer_gets_nothing(curve_broker):
    event, replied = handshake_outcome(curve_broker.address, lambda sock: None)
    assert event in HANDSHAKE_FAILED and not replied

    def right_key(sock):
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = curve_broker.public_key
    assert handshake_outcome(curve_broker.address, right_key) == (zmq.EVENT_HANDSHAKE_SUCCEEDED, True)


def test_status_cli_over_curve(curve_broker):
    r = tgw_broker("status", "--address", curve_broker.address, "--server-key", curve_broker.public_file)
    assert r.returncode == 0, r.stderr
    assert f"{curve_broker.address}: serving" in r.stdout
    r = tgw_broker("status", "--address", curve_broker.address, "--json",
                   env={"TGW_SERVER_KEY": curve_broker.public_key.decode()})
    assert r.returncode == 0 and '"phase": "serving"' in r.stdout, r.stderr


def test_control_ops_are_refused_on_tcp_without_a_token_and_metadata_is_not(curve_broker):
    from tgw.shm.wire import Metadata, SetTraffic
    with pytest.raises(TgwError) as info:
        ask(curve_broker.address, SetTraffic(v=PROTOCOL_VERSION, model="mlp", weights={"1": 1}),
            server_key=curve_broker.public_file)
    assert info.value.code is Code.UNAUTHENTICATED and "auth_token_file" in info.value.message
    meta = ask(curve_broker.address, Metadata(v=PROTOCOL_VERSION, model="mlp"), server_key=curve_broker.public_file)
    assert meta.models[0].name == "mlp"
