"""Rules kept in one place: the CURVE server-key parser (tgw.shm.keys) that the client and the
`tgw-broker` verbs share, the GPU UUID normaliser (tgw.shm.devices), and the 64-byte alignment
the client's regions take from tgw.shm.ring. (No import circle, client/ included:
tests/unit/test_import_graph.py; the size budget: tests/unit/test_module_size.py; what each
package loads, and that tgw.shm.keys and tgw.shm.devices load no zmq: tests/process/test_layering.py.)"""
from __future__ import annotations

import pytest
import zmq
import zmq.auth

from tgw.broker.cli.ask import Unreachable
from tgw.broker.cli.ask import server_public_key as broker_key
from tgw.client import ConnectError
from tgw.client.settings import server_public_key as client_key
from tgw.shm import ring
from tgw.shm.devices import norm_uuid
from tgw.shm.keys import BadServerKey, server_public_key


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    public, secret = zmq.auth.create_certificates(str(tmp_path_factory.mktemp("keys")), "broker")
    return public, secret, zmq.auth.load_certificate(public)[0]


# ---- the CURVE server key -------------------------------------------------------------------

def test_key_forms(certificates):
    public, secret, key = certificates
    assert server_public_key(key.decode()) == server_public_key(key) == key
    assert server_public_key(f"  {key.decode()}\n") == key        # as read from a file or the environment
    assert server_public_key(public) == server_public_key(secret) == key


@pytest.mark.parametrize("bad", ["short", "x" * 40 + "y", "~" * 40, "/nonexistent/broker.key", b"\xff" * 40])
def test_what_is_not_a_key(bad):
    with pytest.raises(BadServerKey, match="neither a 40-character z85 CURVE public key"):
        server_public_key(bad)


def test_an_unreadable_key_file(tmp_path):
    no_key = tmp_path / "empty.key"
    no_key.write_text("# a certificate without its public-key line\n")
    with pytest.raises(ValueError, match="cannot read the server key file"):
        server_public_key(str(no_key))


@pytest.mark.parametrize("bad", ["short", "/nonexistent/broker.key"])
def test_client_and_broker_wrap_the_same_message(bad):
    with pytest.raises(BadServerKey) as shared:
        server_public_key(bad)
    with pytest.raises(ConnectError) as client:
        client_key(bad)
    with pytest.raises(Unreachable) as broker:
        broker_key(bad)
    assert str(client.value) == str(broker.value) == str(shared.value)


# ---- GPU UUIDs --------------------------------------------------------------------------------

@pytest.mark.parametrize("spelling", ["GPU-8e5b1c2d-0000-4a1f-9c3e-1234567890ab",
                                      "gpu-8e5b1c2d-0000-4a1f-9c3e-1234567890ab",
                                      "MIG-8e5b1c2d-0000-4a1f-9c3e-1234567890ab",
                                      "8E5B1C2D-0000-4A1F-9C3E-1234567890AB",
                                      " 8e5b1c2d-0000-4a1f-9c3e-1234567890ab\n"])
def test_uuid_spellings_of_one_device_agree(spelling):
    assert norm_uuid(spelling) == "8e5b1c2d-0000-4a1f-9c3e-1234567890ab"


def test_an_unknown_uuid_stays_empty():
    assert norm_uuid("") == ""


# ---- one alignment ------------------------------------------------------------------------------

def test_regions_align_as_the_ring_does():
    from tgw.client import regions
    assert regions.align_up is ring.align_up
    assert regions.output_bytes_for([1, 64, 65]) == 64 + 64 + 128
