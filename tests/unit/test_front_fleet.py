"""The fronts' supervision pieces that need no process: how many fronts, the run folder's name,
the public port held (a port in use refused), and the Directory's change detection."""
from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from tgw.broker.config.schema import ServerDecl
from tgw.broker.config.startup import StartupError
from tgw.broker.fronts.directory import HEADER_S, DirectoryBook
from tgw.broker.fronts.fleet import front_count, reserve_port, run_dir_of

pytestmark = pytest.mark.unit


def test_front_count_is_the_key_or_a_quarter_of_the_cpus_from_five_up_to_eight():
    assert front_count(ServerDecl(front_processes=3), cpus=64) == 3
    assert front_count(ServerDecl(front_processes=0), cpus=64) == 0
    auto = ServerDecl()
    assert [front_count(auto, cpus=n) for n in (1, 2, 4, 5, 8, 16, 32, 64)] == [0, 0, 0, 1, 2, 4, 8, 8]


def test_the_run_folder_sits_beside_the_workers_socket():
    assert run_dir_of("ipc:///run/user/1000/tgw-42.w.sock") == "/run/user/1000/tgw-42.fronts"


def test_a_port_is_held_for_the_fronts_and_one_another_program_listens_on_refused():
    held = reserve_port("127.0.0.1", 0, "http")
    other = socket.socket()
    try:
        port = held.getsockname()[1]
        assert port > 0
        front = socket.socket()   # a front listens beside the held socket
        front.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        front.bind(("127.0.0.1", port))
        front.listen()
        front.close()
        for reuseport in (0, 1):   # another program's listener, sharing allowed or not
            other.close()
            other = socket.socket()
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, reuseport)
            other.bind(("127.0.0.1", 0))
            other.listen()
            taken = other.getsockname()[1]
            with pytest.raises(StartupError, match=f"http face: cannot listen on 127.0.0.1:{taken}"):
                reserve_port("127.0.0.1", taken, "http")
    finally:
        held.close()
        other.close()


def test_the_directory_grows_its_generation_only_on_a_change():
    now = [0.0]
    registry = SimpleNamespace(generation=0, models={})
    pipelines = SimpleNamespace(table={})
    load = SimpleNamespace(header="a", draining=False)
    book = DirectoryBook(registry, pipelines, load, lambda: now[0])
    assert book.refresh() and book.current.generation == 1 and book.current.load_header == "a"
    assert not book.refresh()                       # nothing changed
    load.header = "b"
    assert not book.refresh()                       # a new header waits its time...
    now[0] += HEADER_S
    assert book.refresh() and book.current.load_header == "b" and book.current.generation == 2
    load.draining = True                            # ...the drain notice does not
    assert book.refresh() and book.current.draining and book.current.generation == 3
    registry.generation += 1                        # looked at again, the same models: no change
    assert not book.refresh()
