"""Read buffer pool (aiproxy/_fast/bufpool.pyx) and the read path it replaced.

`old_read_path` is what a request read cost before the pool: uvloop hands data_received a
new bytes object, the connection appends it to its bytearray, parses there and deletes
the consumed head. `slab_read_path` is the path now: the bytes are already in a pooled
slab (uvloop read into it), the head is parsed in place and the slab goes back. The
copy uvloop makes for data_received (into the new bytes) is included in the old path
as bytes(slab[:n]).
"""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvloop
from aiproxy._fast.bufpool import BufferPool, copy_out
from aiproxy._fast.h1 import parse_request

REQUEST = (b"GET /v1/models HTTP/1.1\r\nHost: api.example.com\r\nUser-Agent: curl/8.5.0\r\n"
           b"Accept: */*\r\n\r\n")


def test_pool_get_put(benchmark) -> None:
    pool = BufferPool(65536, 64)

    def cycle() -> None:
        pool.put(pool.get())

    benchmark(cycle)
    assert pool.misses == 1


@pytest.fixture(scope="module")
def drained_transport():
    """A real uvloop TCP transport with nothing queued (get_write_buffer_size() == 0)."""
    loop = uvloop.new_event_loop()
    a, b = socket.socketpair()

    async def connect() -> asyncio.Transport:
        transport, _ = await loop.create_connection(asyncio.Protocol, sock=a)
        return transport

    transport = loop.run_until_complete(connect())
    yield transport
    transport.close()
    loop.run_until_complete(asyncio.sleep(0))
    b.close()
    loop.close()


def test_pool_lend_drained(benchmark, drained_transport) -> None:
    pool = BufferPool(65536, 64)

    def cycle() -> None:
        pool.lend(pool.get(), drained_transport)

    benchmark(cycle)
    assert pool.held == 0


@pytest.mark.parametrize("size", [16 * 1024, 64 * 1024])
def test_copy_out(benchmark, size: int) -> None:
    slab = bytearray(65536)
    benchmark(copy_out, slab, 0, size)


@pytest.mark.parametrize("size", [16 * 1024, 64 * 1024])
def test_bytes_of_memoryview_slice(benchmark, size: int) -> None:
    slab = bytearray(65536)
    benchmark(lambda: bytes(memoryview(slab)[:size]))


def test_old_read_path(benchmark) -> None:
    slab = bytearray(65536)
    slab[:len(REQUEST)] = REQUEST
    n = len(REQUEST)
    buf = bytearray()

    def read() -> None:
        data = bytes(memoryview(slab)[:n])  # uvloop's new bytes for data_received
        buf.extend(data)
        head = parse_request(buf, 32768, 8192, 100)
        del buf[:head.consumed]

    benchmark(read)


def test_slab_read_path(benchmark) -> None:
    pool = BufferPool(65536, 64)
    n = len(REQUEST)

    def read() -> None:
        slab = pool.get()
        slab[:n] = REQUEST  # stands for the read uvloop does into the slab
        parse_request(slab, 32768, 8192, 100, n)
        pool.put(slab)

    benchmark(read)
