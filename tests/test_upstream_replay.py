"""Replays and retries against real upstreams: a replay after a stale keep-alive
connection obeys the cluster's connection breakers, retries stay on healthy endpoints
(unhealthy ones only in panic mode), and a non-idempotent request is not sent twice
unless the route allows it."""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.h2_support import Pki, make_pki
from tests.support import free_port, wait_port
from tests.test_routing_e2e import cluster, tunable  # noqa: F401 (fixture)

SINGLE_PROCESS = "\n[server]\nworkers = 1\n"
ROUTE = """
[[routes]]
name = "r"
match = { path_prefix = "/" }
cluster = "c"
"""


class StaleTlsUpstream:
    """HTTP/1.1 over TLS in its own thread. It answers the first request on each
    connection (once `answer` is set) and closes a connection when a second request
    arrives on it, without answering: a keep-alive connection that went stale. While
    `hold` is set, new connections wait before their TLS handshake until `release`,
    so the proxy's connection attempts stay pending and can be counted (`held`)."""

    def __init__(self, pki: Pki) -> None:
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(pki.cert, pki.key)
        self.accepted = 0
        self.requests = 0
        self.dropped = 0
        self.held = 0
        self.max_held = 0
        self.hold = False
        self.tasks: set[asyncio.Task] = set()
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.answer = asyncio.Event()
        self.release = asyncio.Event()
        listener = socket.create_server(("127.0.0.1", self.port))
        listener.setblocking(False)
        accepting = self.loop.create_task(self._accept(listener))
        self._ready.set()
        self.loop.run_forever()
        accepting.cancel()
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        listener.close()
        self.loop.close()

    def set(self, event: str) -> None:
        self.loop.call_soon_threadsafe(getattr(self, event).set)

    async def _accept(self, listener: socket.socket) -> None:
        while True:
            sock, _ = await self.loop.sock_accept(listener)
            self.accepted += 1
            task = self.loop.create_task(self._conn(sock))
            self.tasks.add(task)  # a task nothing refers to may be collected mid-wait
            task.add_done_callback(self.tasks.discard)

    async def _conn(self, sock: socket.socket) -> None:
        # Nothing is read before the handshake: the ClientHello waits in the socket.
        if self.hold:
            self.held += 1
            self.max_held = max(self.max_held, self.held)
            try:
                await self.release.wait()
            finally:
                self.held -= 1
        reader = asyncio.StreamReader()
        protocol = asyncio.StreamReaderProtocol(reader)
        try:
            transport, _ = await self.loop.connect_accepted_socket(
                lambda: protocol, sock, ssl=self.ctx)
        except (ConnectionError, ssl.SSLError, OSError):
            sock.close()
            return
        writer = asyncio.StreamWriter(transport, protocol, reader, self.loop)
        try:
            n = 0
            while True:
                await reader.readuntil(b"\r\n\r\n")
                n += 1
                if n > 1:
                    self.dropped += 1
                    return
                self.requests += 1
                await self.answer.wait()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if not shutil.which("openssl"):
        pytest.skip("needs openssl")
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def stale_upstream(pki: Pki) -> Iterator[StaleTlsUpstream]:
    up = StaleTlsUpstream(pki)
    yield up
    up.stop()


def wait_for(what, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.mark.parametrize(("limit", "statuses"), [
    ("max_pending = 1", [200, 503, 503]),
    # The stale connections' slots are free again: every replay gets its connection.
    ("max_connections = 3", [200, 200, 200]),
])
def test_stale_connection_replays_obey_connection_breakers(
        start_proxy, stale_upstream: StaleTlsUpstream, pki: Pki, limit: str,
        statuses: list[int]) -> None:
    up = stale_upstream
    n = 3
    proxy = start_proxy(SINGLE_PROCESS + f"""
[[clusters]]
name = "c"
endpoints = ["127.0.0.1:{up.port}"]
tls = {{ ca = "{pki.ca}" }}
connect_timeout_ms = 10000
{limit}
""" + ROUTE)

    async def run() -> tuple[list[int], list[dict]]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(base_url=proxy.url, timeout=20, limits=limits) as client:
            # n upstream connections, opened one at a time (within max_pending), then idle.
            warm = []
            for i in range(n):
                warm.append(asyncio.create_task(client.get("/warm")))
                while up.requests < i + 1:
                    await asyncio.sleep(0.01)
            up.set("answer")
            assert [r.status_code for r in await asyncio.gather(*warm)] == [200] * n
            # Each of n requests takes a pooled connection, which the upstream closes:
            # each is replayed, and the new connections are held before TLS, pending.
            up.hold = True
            burst = [asyncio.create_task(client.get("/burst")) for _ in range(n)]
            deadline = time.monotonic() + 10
            while up.held + sum(t.done() for t in burst) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            up.set("release")
            done = await asyncio.gather(*burst)
            return (sorted(r.status_code for r in done),
                    [r.json() for r in done if r.status_code != 200])

    got, errors = asyncio.run(run())
    assert up.dropped == n, (up.accepted, up.requests, up.max_held, got, errors)
    assert got == statuses, (got, errors)
    assert all(e["error"]["code"] == "upstream_overflow" for e in errors), errors
    assert up.max_held == statuses.count(200)
    assert up.accepted == n + statuses.count(200)


def admin_clusters(port: int) -> list[dict]:
    return httpx.get(f"http://127.0.0.1:{port}/clusters").json()


def test_retries_stay_on_healthy_endpoints(start_proxy, tunable) -> None:  # noqa: F811
    healthy = tunable("healthy", status=503)  # passes its checks, answers 503
    sick = tunable("sick")  # fails its checks; would answer 200
    sick.health_status = 500
    admin_port = free_port()
    proxy = start_proxy(SINGLE_PROCESS + cluster("c", healthy.port, sick.port, extra="""
health_check = { path = "/healthz", interval_ms = 100, unhealthy_threshold = 1 }
outlier_detection = { consecutive_failures = 0 }
""") + f'\n[admin]\naddress = "127.0.0.1:{admin_port}"\n' + """
[[routes]]
name = "r"
match = { path_prefix = "/" }
cluster = "c"
retries = { attempts = 2, on = ["503"], backoff_ms = 1 }
""")
    wait_port("127.0.0.1", admin_port)
    sick_addr = f"127.0.0.1:{sick.port}"

    def sick_out() -> bool:
        eps = admin_clusters(admin_port)[0]["endpoints"]
        return not next(e for e in eps if e["address"] == sick_addr)["available"]

    wait_for(sick_out)
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        for _ in range(5):
            r = client.get("/x")
            # Every attempt went to the healthy endpoint: its 503 is the answer.
            assert r.status_code == 503 and r.headers["x-upstream"] == "healthy"
    assert sick.requests == 0
    assert healthy.requests == 15
    # Panic mode (no endpoint available): the unhealthy one is used again.
    healthy.health_status = 500
    wait_for(lambda: not any(e["available"] for e in admin_clusters(admin_port)[0]["endpoints"]))
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        assert client.get("/x").status_code == 200
    assert sick.requests == 1


@pytest.mark.parametrize("non_idempotent", [False, True])
def test_post_answered_5xx_is_retried_only_when_allowed(start_proxy, tunable,  # noqa: F811
                                                        non_idempotent: bool) -> None:
    """RFC 9110 9.2.2: the upstream answered, so it may have acted on the POST."""
    a, b = tunable("a"), tunable("b")
    flag = str(non_idempotent).lower()
    # Each round leaves the endpoint that did not answer last one failure further on;
    # by the third round outlier detection would eject it and a retry would find one
    # endpoint. This test is about retries: ejection is off.
    proxy = start_proxy(cluster("c", a.port, b.port, extra="""
outlier_detection = { consecutive_failures = 0 }
""") + f"""
[[routes]]
name = "r"
match = {{ path_prefix = "/" }}
cluster = "c"
retries = {{ attempts = 2, on = ["502", "503", "504"], backoff_ms = 1, non_idempotent = {flag} }}
""")
    for status in (502, 503, 504):
        a.fail_first = b.fail_first = 1
        a.fail_status = b.fail_status = status
        a.requests = b.requests = 0
        r = httpx.post(proxy.url + "/charge", content=b"payload")
        if non_idempotent:  # each endpoint fails once: two retries, the third answers
            assert r.status_code == 200 and r.json()["body_bytes"] == 7
            assert a.requests + b.requests == 3
        else:
            assert r.status_code == status
            assert a.requests + b.requests == 1
        # PUT is idempotent: retried either way, its body replayed whole.
        a.fail_first = b.fail_first = 1
        a.requests = b.requests = 0
        r = httpx.put(proxy.url + "/doc", content=b"payload")
        assert r.status_code == 200 and r.json()["body_bytes"] == 7
        assert a.requests + b.requests == 3
