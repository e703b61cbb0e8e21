"""The uvloop that scripts/bootstrap.sh builds with patches/uvloop-0.23.0-poll-hooks.patch:
the loop holds the GIL through libuv's callbacks and lets it go around each poll for I/O.
These check that it is the build installed, and that other threads still get the GIL both
while the loop waits and while it is busy."""

import asyncio
import hashlib
import os
import socket
import threading
from pathlib import Path

import pytest
import uvloop
import uvloop.loop

PATCH = Path(__file__).resolve().parent.parent / "patches" / "uvloop-0.23.0-poll-hooks.patch"


@pytest.mark.skipif(os.environ.get("AIPROXY_UVLOOP_PATCH") == "0",
                    reason="AIPROXY_UVLOOP_PATCH=0: the stock uvloop was kept on purpose")
def test_the_installed_uvloop_is_the_patched_build() -> None:
    key = hashlib.sha256(PATCH.read_bytes()).hexdigest()[:16]
    assert uvloop.__version__ == "0.23.0"
    assert getattr(uvloop.loop, "PATCH_KEY", None) == key, (
        "uvloop is not built from patches/: run scripts/bootstrap.sh "
        "(build/uvloop/build.log has the last build's output)")
    assert uvloop.loop.GIL_HELD_IN_CALLBACKS is True


def test_a_thread_runs_while_the_loop_waits_for_io() -> None:
    """The loop sits in epoll_wait with nothing to do: a thread must get the GIL."""
    progressed = threading.Event()
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1  # Python bytecode: needs the GIL
            if n == 100_000:
                progressed.set()

    async def main() -> bool:
        loop = asyncio.get_running_loop()
        waker = loop.create_future()
        t = threading.Thread(target=spin)
        t.start()
        try:
            # The thread wakes the loop itself (call_soon_threadsafe), so this returns only
            # if the thread ran while the loop was blocked in its poll.
            threading.Thread(target=lambda: (progressed.wait(30),
                                             loop.call_soon_threadsafe(waker.set_result, 1))
                             ).start()
            await asyncio.wait_for(waker, 30)
            return progressed.is_set()
        finally:
            stop.set()
            t.join()

    assert uvloop.run(main())


def test_a_thread_and_a_busy_loop_both_progress() -> None:
    """The loop keeps answering socket reads (callbacks back to back); a thread spinning on
    Python code must still get turns, and the loop must still finish."""
    rounds = 3000
    counted = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            counted[0] += 1

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.transport.write(data)

    class Pinger(asyncio.Protocol):
        def __init__(self, done: asyncio.Future) -> None:
            self.done = done
            self.left = rounds
            self.seen_during = 0

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            transport.write(b"x")

        def data_received(self, data: bytes) -> None:
            self.left -= 1
            if self.left == rounds // 2:
                self.seen_during = counted[0]
            if self.left == 0:
                self.done.set_result(self.seen_during)
            else:
                self.transport.write(b"x")

    async def main() -> int:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        done = loop.create_future()
        await loop.connect_accepted_socket(Echo, a)
        t_ping, _ = await loop.connect_accepted_socket(lambda: Pinger(done), b)
        t = threading.Thread(target=spin)
        t.start()
        try:
            return await asyncio.wait_for(done, 60)
        finally:
            stop.set()
            t.join()
            t_ping.close()

    seen = uvloop.run(main())
    assert seen > 0  # the thread had run by the time the loop was half way
    assert counted[0] > seen  # and went on running while the loop worked


def test_run_in_executor_round_trips() -> None:
    """Executor threads hand results back through call_soon_threadsafe (uv_async)."""
    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        return list(await asyncio.gather(
            *(loop.run_in_executor(None, pow, i, 2) for i in range(200))))

    assert uvloop.run(main()) == [i * i for i in range(200)]
