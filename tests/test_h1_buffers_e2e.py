"""Read buffers end to end: large bodies through the proxy stay intact while a client
reads slowly (so the proxy's writes to it stay queued and the slabs they came from
are parked), other clients churn the pool, and requests are pipelined.

Real parts: nginx serves random files (Content-Length bodies, which the proxy forwards
as views of its read slabs), the aiohttp demo upstream echoes upload digests, a small
socket upstream reads uploads slowly, and the clients are raw sockets and httpx.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import free_port, run_nginx, wait_ready

SIZES = {"a.bin": 3 * 1024 * 1024 + 17, "b.bin": 2 * 1024 * 1024 + 65537,
         "c.bin": 1024 * 1024 + 3, "d.bin": 700_001, "s.bin": 100, "t.bin": 2048,
         "u.bin": 8192}


@pytest.fixture
def files(tmp_path: Path) -> dict[str, bytes]:
    www = tmp_path / "www"
    www.mkdir()
    out = {}
    rng = random.Random(7)
    for name, size in SIZES.items():
        data = rng.randbytes(size)
        (www / name).write_bytes(data)
        out[name] = data
    for p in (tmp_path, www, *www.iterdir()):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return out


@pytest.fixture
def nginx_files(tmp_path: Path, files: dict[str, bytes]) -> Iterator[int]:
    """nginx serving the random files from tmp_path/www."""
    with run_nginx(tmp_path, f'        location / {{ root {tmp_path / "www"}; }}') as port:
        yield port


class SlowReadingUpstream:
    """A socket upstream that reads request bodies slowly (small receive buffer, a stall,
    then 4 KiB per read with a pause) and answers each with the body's sha256: the
    proxy's writes of request body views to it stay queued."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self.threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        buf = bytearray()

        def more(slow: bool = True) -> None:
            data = conn.recv(4096 if slow else 65536)
            if not data:
                raise EOFError
            buf.extend(data)
            if slow:
                time.sleep(0.001)

        def line() -> bytes:
            while b"\r\n" not in buf:
                more()
            end = buf.index(b"\r\n") + 2
            out = bytes(buf[:end])
            del buf[:end]
            return out

        def body(length: int, digest: Any) -> None:
            # Stall first (the proxy fills the kernel's socket buffers, up to several
            # MiB on loopback, and then its own), then crawl for a while, then read on.
            time.sleep(0.3)
            got = 0
            while got < length:
                if not buf:
                    more(got < 1 << 20)
                take = min(len(buf), length - got)
                digest.update(buf[:take])
                del buf[:take]
                got += take

        with conn, contextlib.suppress(EOFError, OSError):
            while not self.stop.is_set():
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    head += line()
                head = head.lower()
                digest = hashlib.sha256()
                if b"transfer-encoding: chunked" in head:
                    while (size := int(line().split(b";")[0], 16)) > 0:
                        body(size, digest)
                        line()
                    while line() != b"\r\n":  # trailers
                        pass
                else:
                    body(int(head.split(b"content-length:")[1].split(b"\r\n")[0]), digest)
                out = digest.hexdigest().encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(out), out))

    def close(self) -> None:
        self.stop.set()
        self.threads[0].join(5)  # the accept loop, before its socket goes
        self.sock.close()
        for t in self.threads[1:]:
            t.join(5)


@pytest.fixture
def slow_upstream() -> Iterator[int]:
    up = SlowReadingUpstream()
    yield up.port
    up.close()


def config(files_port: int, echo_port: int, admin_port: int, slow_port: int = 0) -> str:
    slow = f"""
[[clusters]]
name = "slow"
endpoints = ["127.0.0.1:{slow_port}"]

[[routes]]
name = "slow"
match = {{ path_prefix = "/slow" }}
cluster = "slow"
""" if slow_port else ""
    return f"""
[admin]
address = "127.0.0.1:{admin_port}"
{slow}
[[clusters]]
name = "files"
endpoints = ["127.0.0.1:{files_port}"]

[[clusters]]
name = "echo"
endpoints = ["127.0.0.1:{echo_port}"]

[[routes]]
name = "echo"
match = {{ path_prefix = "/echo" }}
cluster = "echo"

[[routes]]
name = "files"
match = {{ path_prefix = "/" }}
cluster = "files"
"""


def read_response(sock: socket.socket, buf: bytearray, chunk: int, pause: float) -> tuple[
        int, bytes]:
    """One Content-Length response from sock (reading `chunk` bytes at a time with a
    pause after each read); returns (status, body) and leaves the rest in buf."""
    def fill() -> None:
        data = sock.recv(chunk)
        if not data:
            raise AssertionError("connection closed mid-response")
        buf.extend(data)
        if pause:
            time.sleep(pause)

    while b"\r\n\r\n" not in buf:
        fill()
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end]).decode("latin-1").split("\r\n")
    del buf[:end]
    status = int(head[0].split()[1])
    length = None
    for line in head[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
        assert name.strip().lower() != "transfer-encoding", "expected a Content-Length body"
    assert length is not None
    while len(buf) < length:
        fill()
    body = bytes(buf[:length])
    del buf[:length]
    return status, body


def churn(base: str, names: list[str], files: dict[str, bytes], stop: threading.Event,
          errors: list[str]) -> None:
    """Fast clients: keep fetching bodies so freed slabs are refilled with other bytes."""
    with httpx.Client(base_url=base, timeout=30) as client:
        i = 0
        while not stop.is_set():
            name = names[i % len(names)]
            i += 1
            r = client.get(f"/{name}")
            if r.status_code != 200 or hashlib.sha256(r.content).digest() != hashlib.sha256(
                    files[name]).digest():
                errors.append(f"churn {name}: {r.status_code}, {len(r.content)} bytes")
                return


def metrics(admin_port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{admin_port}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("aiproxy_buffer_pool"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_slow_pipelined_reader_gets_intact_bodies(start_proxy, nginx_files, demo_upstream,
                                                  files) -> None:
    admin = free_port()
    proxy = start_proxy(config(nginx_files, demo_upstream, admin))
    wait_ready(admin)
    before = metrics(admin)
    stop = threading.Event()
    errors: list[str] = []
    churners = [threading.Thread(target=churn, args=(proxy.url, names, files, stop, errors))
                for names in (["d.bin", "c.bin"], ["b.bin", "d.bin"])]
    for t in churners:
        t.start()
    upload = os.urandom(1_500_000)
    try:
        sock = socket.socket()
        # A small receive buffer: the proxy's writes to this client back up at once.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        sock.connect(("127.0.0.1", proxy.port))
        sock.settimeout(60)
        order = ["a.bin", "b.bin", "c.bin", "a.bin"]
        pipelined = b"".join(f"GET /{n} HTTP/1.1\r\nHost: t\r\n\r\n".encode() for n in order)
        pipelined += (b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n"
                      % len(upload)) + upload
        pipelined += b"GET /d.bin HTTP/1.1\r\nHost: t\r\n\r\n"
        sock.sendall(pipelined)
        buf = bytearray()
        for i, name in enumerate(order):
            # The first bodies crawl (4 KiB per read, 1 ms apart); later ones read faster.
            status, body = read_response(sock, buf, 4096 if i < 2 else 65536,
                                         0.001 if i < 2 else 0)
            assert status == 200
            assert len(body) == len(files[name]), name
            assert hashlib.sha256(body).digest() == hashlib.sha256(files[name]).digest(), name
        status, body = read_response(sock, buf, 65536, 0)
        assert status == 200
        echo = json.loads(body)
        assert echo["body_bytes"] == len(upload)
        assert echo["body_sha256"] == hashlib.sha256(upload).hexdigest()
        status, body = read_response(sock, buf, 65536, 0)
        assert status == 200 and body == files["d.bin"]
        sock.close()
    finally:
        stop.set()
        for t in churners:
            t.join(60)
    assert not errors, errors
    after = metrics(admin)
    # The slow reader made the proxy park slabs (views still queued in its transport)...
    assert after["aiproxy_buffer_pool_parked_total"] > before.get(
        "aiproxy_buffer_pool_parked_total", 0)
    assert after["aiproxy_buffer_pool_gets_total"] > before["aiproxy_buffer_pool_gets_total"]
    # ... and once every client is done, none is held or in use any more (a scrape
    # reads only; a parked slab comes back on a later get, so make one).
    httpx.get(f"{proxy.url}/d.bin", timeout=10)
    deadline = time.monotonic() + 10
    while True:
        m = metrics(admin)
        if m['aiproxy_buffer_pool_slabs{state="in_use"}'] == 0:
            break
        assert time.monotonic() < deadline, m
        httpx.get(f"{proxy.url}/d.bin", timeout=10)
        time.sleep(0.2)
    assert m['aiproxy_buffer_pool_slabs{state="held"}'] == 0
    assert m['aiproxy_buffer_pool_slabs{state="free"}'] > 0


def test_uploads_to_a_slow_upstream_arrive_intact(start_proxy, nginx_files, demo_upstream,
                                                  slow_upstream, files) -> None:
    """Request bodies go to an HTTP/1.1 upstream as views of the client's read slabs; the
    upstream reads slowly, so those writes queue and the slabs park, while downloads by
    other clients reuse every free slab."""
    admin = free_port()
    proxy = start_proxy(config(nginx_files, demo_upstream, admin, slow_upstream))
    wait_ready(admin)
    before = metrics(admin)
    stop = threading.Event()
    errors: list[str] = []
    churners = [threading.Thread(target=churn, args=(proxy.url, names, files, stop, errors))
                for names in (["d.bin", "c.bin"], ["b.bin"])]
    for t in churners:
        t.start()
    uploads = [os.urandom(6_000_000 + i * 77_777) for i in range(3)]
    try:
        sock = socket.socket()
        sock.connect(("127.0.0.1", proxy.port))
        sock.settimeout(60)
        # Pipelined: two uploads back to back, then a download.
        for body in uploads[:2]:
            sock.sendall(b"POST /slow/up HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n"
                         % len(body) + body)
        sock.sendall(b"GET /c.bin HTTP/1.1\r\nHost: t\r\n\r\n")
        buf = bytearray()
        for body in uploads[:2]:
            status, digest = read_response(sock, buf, 65536, 0)
            assert status == 200
            assert digest.decode() == hashlib.sha256(body).hexdigest()
        status, body = read_response(sock, buf, 65536, 0)
        assert status == 200 and body == files["c.bin"]
        sock.close()
        # A chunked upload (decoded by the proxy, re-chunked upstream) from httpx.
        r = httpx.post(f"{proxy.url}/slow/chunked", content=iter([uploads[2][:999_999],
                                                                   uploads[2][999_999:]]),
                       timeout=60)
        assert r.status_code == 200 and r.text == hashlib.sha256(uploads[2]).hexdigest()
    finally:
        stop.set()
        for t in churners:
            t.join(60)
    assert not errors, errors
    after = metrics(admin)
    assert after["aiproxy_buffer_pool_parked_total"] > before.get(
        "aiproxy_buffer_pool_parked_total", 0)


def test_a_client_that_keeps_up_parks_no_slab(start_proxy, nginx_files, demo_upstream,
                                              files) -> None:
    """Response bytes go to a client's socket at once while nothing is queued for it
    (sendnow.pyx), so a body sent as a view of the read slab (over 2 KiB) leaves the
    slab free as the write returns, the same as a body sent as a copy."""
    admin = free_port()
    proxy = start_proxy(config(nginx_files, demo_upstream, admin))
    wait_ready(admin)
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        client.get("/s.bin")
        before = metrics(admin)
        for _ in range(50):
            for name in ("s.bin", "t.bin", "u.bin"):
                r = client.get(f"/{name}")
                assert r.status_code == 200 and r.content == files[name], name
        after = metrics(admin)
        assert after["aiproxy_buffer_pool_gets_total"] >= before["aiproxy_buffer_pool_gets_total"] + 300
        assert after["aiproxy_buffer_pool_parked_total"] == before["aiproxy_buffer_pool_parked_total"]
