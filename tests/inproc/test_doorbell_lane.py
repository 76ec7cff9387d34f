"""The worker lane (shm/doorbell.py) and the broker's end of it (broker/fleet/worker_link.py), over
real socketpairs: messages whole and in order whatever pieces they arrive in, every lane with
something to say read before one serving flush, what was sent before
the peer's exit read before its EOF, EOF as the liveness signal both ways, and a broker send the
socket cannot take yet queued, in order, not dropped."""
from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

from tgw.broker.fleet.worker_link import WorkerLink
from tgw.shm import doorbell
from tgw.shm.wire import Done, Release, encode, from_worker_decoder, to_worker_decoder


def test_the_worker_end_reads_whole_messages_in_order_then_eof():
    mine, theirs = doorbell.pair()
    lane = doorbell.Lane(theirs)
    big = bytes(range(256)) * 1024   # 256 KiB: longer than a read, the buffer grows for it
    sent = [b"", b"x" * 10, big, b"last"]
    wire = b"".join(doorbell.frame(m) for m in sent)
    assert not lane.poll(0)
    mine.sendall(wire[:3])   # a header in pieces: nothing whole yet
    writer = threading.Thread(target=lambda: [mine.sendall(wire[i:i + 7000]) for i in range(3, len(wire), 7000)])
    writer.start()
    got = [lane.recv() for _ in sent]
    writer.join()
    assert got == sent
    mine.sendall(doorbell.frame(b"before the end"))
    mine.close()   # the broker's exit: what it sent first, then EOF
    assert lane.poll(0) and lane.recv() == b"before the end"
    assert lane.poll(0)   # EOF is readable at once
    with pytest.raises(doorbell.LaneClosed):
        lane.recv()
    with pytest.raises(doorbell.LaneClosed):
        lane.send(b"to nobody")
    lane.close()


def test_the_broker_end_hands_messages_in_order_queues_what_the_socket_cannot_take_and_sees_eof(tmp_path):
    async def main():
        loop = asyncio.get_running_loop()
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.bind(f"ipc://{tmp_path}/back")
        link = WorkerLink(loop, router, "socket")
        got, flushes, gone = [], [], asyncio.Event()
        link.on_gone = gone.set
        worker_end = link.open_lane(b"w0.1")
        lane = doorbell.Lane(worker_end)

        def handler(frames):
            got.append((frames[0].bytes, from_worker_decoder.decode(frames[1].buffer)))

        link.listen(handler, after=lambda: flushes.append(len(got)))
        # broker -> worker: far more than the socket buffer holds, sent while the worker reads nothing
        n = 20000
        for i in range(n):
            link.send(b"w0.1", Release(blocks=[i, i + 1, i + 2]))
        assert link.lanes[b"w0.1"].out, "the socket took everything: the test sends too little"
        seen = await asyncio.to_thread(lambda: [to_worker_decoder.decode(lane.recv()).blocks[0] for _ in range(n)])
        assert seen == list(range(n))
        # two workers' completions of the same moment: both handled, then the serving flush once
        other = doorbell.Lane(link.open_lane(b"w1.1"))
        before = len(flushes)
        other.send(encode(Done(batch_id=100)))
        for i in range(5):
            lane.send(encode(Done(batch_id=i)))
        while len(got) < 6:
            await asyncio.sleep(0)   # one loop turn: the lanes' poll is ready
        assert flushes[before:] == [6]
        assert sorted((ident, msg.batch_id) for ident, msg in got) == [(b"w0.1", i) for i in range(5)] + [(b"w1.1", 100)]
        assert [msg.batch_id for ident, msg in got if ident == b"w0.1"] == list(range(5))   # in order
        # a worker's exit: its lane's EOF
        lane.close()
        await asyncio.wait_for(gone.wait(), 30)
        assert b"w0.1" not in link.lanes and b"w1.1" in link.lanes   # the dead one's lane dropped, alone
        other.close()
        link.close()
        ctx.term()

    asyncio.run(main())


def test_zmq_mode_opens_no_lanes(tmp_path):
    async def main():
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.bind(f"ipc://{tmp_path}/back")
        link = WorkerLink(asyncio.get_running_loop(), router, "zmq")
        assert link.open_lane(b"w0.1") is None and not link.lanes
        link.close()
        ctx.term()

    asyncio.run(main())
