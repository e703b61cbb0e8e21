"""The read-buffer pool (aiproxy/_fast/bufpool.pyx): counts, bounds, and the rule that a
slab a transport still holds is never handed out again, checked on real uvloop sockets."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest
import uvloop
from aiproxy._fast.bufpool import POOL, BufferPool, copy_out


def test_get_put_counts_and_reuse() -> None:
    pool = BufferPool(4096, 2)
    a = pool.get()
    assert isinstance(a, bytearray) and len(a) == 4096
    assert (pool.in_use, pool.free, pool.misses, pool.gets) == (1, 0, 1, 1)
    pool.put(a)
    assert (pool.in_use, pool.free) == (0, 1)
    assert pool.get() is a  # reused, not allocated
    assert pool.misses == 1 and pool.gets == 2
    pool.put(a)


def test_free_list_is_bounded() -> None:
    pool = BufferPool(1024, 2)
    slabs = [pool.get() for _ in range(5)]
    assert pool.misses == 5 and pool.in_use == 5
    for s in slabs:
        pool.put(s)
    assert pool.free == 2 and pool.dropped == 3 and pool.in_use == 0
    stats = pool.stats()
    assert stats["free"] == 2 and stats["misses"] == 5 and stats["slab_size"] == 1024


def test_foreign_sized_buffer_is_not_kept() -> None:
    pool = BufferPool(1024, 4)
    pool.get()
    pool.put(bytearray(10))
    assert pool.free == 0 and pool.dropped == 1


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        BufferPool(0, 1)
    with pytest.raises(ValueError):
        BufferPool(1024, -1)


def test_copy_out() -> None:
    slab = bytearray(b"0123456789")
    assert copy_out(slab, 2, 5) == b"234"
    assert type(copy_out(slab, 0, 0)) is bytes
    with pytest.raises(IndexError):
        copy_out(slab, 5, 11)
    with pytest.raises(IndexError):
        copy_out(slab, 6, 5)


def test_lend_without_transport_recycles() -> None:
    pool = BufferPool(1024, 4)
    slab = pool.get()
    assert pool.lend(slab, None) is True
    assert pool.free == 1 and pool.in_use == 0


class _Sink(asyncio.Protocol):
    """The receiving end: reads only when told to, and keeps what it read."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.data = bytearray()
        self.got = asyncio.Event()
        self.want = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.pause_reading()  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.data += data
        if len(self.data) >= self.want:
            self.got.set()


async def _pair(loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Transport, _Sink, object]:
    sink = _Sink()
    server = await loop.create_server(lambda: sink, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
    while sink.transport is None:
        await asyncio.sleep(0.01)
    return transport, sink, server


def _fill(writer: asyncio.Transport) -> bytes:
    """Write until the socket buffers are full (the peer is not reading): the next
    write cannot complete at once."""
    chunk = os.urandom(1 << 20)
    out = bytearray()
    while writer.get_write_buffer_size() == 0:
        assert len(out) < 256 << 20, "socket buffers never filled"
        writer.write(chunk)
        out += chunk
    return bytes(out)


def test_slab_held_by_a_blocked_transport_is_not_reused() -> None:
    """A view written to a socket whose peer does not read stays referenced by uvloop:
    the pool parks the slab and hands out others until the bytes have left it."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        writer, sink, server = await _pair(loop)
        pool = BufferPool(1 << 20, 8)
        filler = _fill(writer)
        sent = len(filler)
        slab = pool.get()
        slab[:] = os.urandom(len(slab))
        digest = hashlib.sha256(slab).digest()
        writer.write(memoryview(slab)[:])
        sent += len(slab)
        assert writer.get_write_buffer_size() > 0
        assert pool.lend(slab, writer) is False
        assert pool.held == 1 and pool.parked == 1 and pool.in_use == 1
        others = [pool.get() for _ in range(4)]
        assert all(o is not slab for o in others)
        for o in others:
            o[:] = b"\xee" * len(o)  # what a reuse would do to the bytes in flight
            pool.put(o)
        assert pool.reclaim() == 0 and pool.held == 1
        # Let the peer read everything; the slab comes back only then.
        sink.want = sent
        sink.transport.resume_reading()
        await asyncio.wait_for(sink.got.wait(), 30)
        for _ in range(100):
            if writer.get_write_buffer_size() == 0:
                break
            await asyncio.sleep(0.01)
        assert hashlib.sha256(sink.data[len(filler):]).digest() == digest
        assert pool.reclaim() == 1
        assert pool.held == 0 and pool.in_use == 0
        writer.close()
        server.close()

    uvloop.run(main())


def test_get_reclaims_parked_slabs_when_free_list_is_empty() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        writer, sink, server = await _pair(loop)
        pool = BufferPool(1 << 20, 8)
        filled = len(_fill(writer))
        slab = pool.get()
        writer.write(memoryview(slab))
        assert not pool.lend(slab, writer)
        assert pool.get() is not slab  # still held: a fresh slab (a miss)
        assert pool.misses == 2 and pool.held == 1
        sink.want = filled + len(slab)
        sink.transport.resume_reading()
        await asyncio.wait_for(sink.got.wait(), 30)
        while writer.get_write_buffer_size():
            await asyncio.sleep(0.01)
        # One slab parked: get() checks it (after skipping as many gets as are parked).
        got = [pool.get() for _ in range(3)]
        assert slab in got and pool.held == 0
        writer.close()
        server.close()

    uvloop.run(main())


def test_process_pool_is_shared_and_sized() -> None:
    assert POOL.slab_size == 65536 and POOL.max_free >= 1


def test_parked_slabs_come_back_while_the_free_list_is_not_empty() -> None:
    """Parked slabs must not pile up just because other slabs are free."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        writer, sink, server = await _pair(loop)
        pool = BufferPool(1 << 16, 8)
        spare = pool.get()
        filled = len(_fill(writer))
        parked = []
        for _ in range(4):
            slab = pool.get()
            writer.write(memoryview(slab))
            assert not pool.lend(slab, writer)
            parked.append(slab)
        pool.put(spare)
        assert pool.held == 4 and pool.free >= 1
        sink.want = filled + 4 * len(parked[0])
        sink.transport.resume_reading()
        await asyncio.wait_for(sink.got.wait(), 30)
        while writer.get_write_buffer_size():
            await asyncio.sleep(0.01)
        for _ in range(8):
            pool.put(pool.get())
        assert pool.held == 0 and pool.in_use == 0
        writer.close()
        server.close()

    uvloop.run(main())
