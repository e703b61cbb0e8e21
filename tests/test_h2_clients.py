"""HTTP/2 with real clients: h2load, nghttp, curl and httpx against h2c, HTTP/1.1+h2c,
TLS (ALPN h2 / http/1.1) and mTLS listeners; and protocol translation both ways:
HTTP/2 clients to the HTTP/1.1 demo upstream, HTTP/1.1 clients to an HTTP/2 upstream."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import shutil
import socketserver
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hyperframe.frame import DataFrame, RstStreamFrame

from tests.h2_support import (
    BLOCK,
    FrameClient,
    H2Upstream,
    Pki,
    ProxyProc,
    RssMonitor,
    bytes_sha256,
    client_tls,
    h2_get,
    make_pki,
    wait_for,
)
from tests.support import raw_exchange, stops_reading

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not (shutil.which("h2load") and shutil.which("nghttp")
                            and shutil.which("curl") and shutil.which("openssl")),
                       reason="needs h2load, nghttp (nghttp2-client), curl and openssl"),
]

MiB = 1024 * 1024
H2UP_HOST = "h2up.test"

CONFIG = """
[server]
# test_upload_to_stalled_h2_upstream_memory_bounded[h1] leaves a connection the proxy
# holds until its read timeout (reading is paused, so the client's close goes unseen):
# do not wait the default 10 s for it at shutdown.
drain_timeout_ms = 2000

[[listeners]]
name = "h2c"
address = "127.0.0.1:{h2c}"
protocols = ["h2c"]

[[listeners]]
name = "mixed"
address = "127.0.0.1:{mixed}"
protocols = ["http1", "h2c"]

[[listeners]]
name = "h1"
address = "127.0.0.1:{h1}"
protocols = ["http1"]

[[listeners]]
name = "tls"
address = "127.0.0.1:{tls}"
protocols = ["h2", "http1"]
tls = { cert = "{cert}", key = "{key}" }

[[listeners]]
name = "mtls"
address = "127.0.0.1:{mtls}"
protocols = ["h2", "http1"]
tls = { cert = "{cert}", key = "{key}", ca = "{ca}" }

[[clusters]]
name = "demo"
endpoints = ["127.0.0.1:{demo}"]

[[clusters]]
name = "h2up"
endpoints = ["127.0.0.1:{h2up}"]
protocol = "h2"

[[clusters]]
name = "narrow"
endpoints = ["127.0.0.1:{narrow}"]
protocol = "h2"

[[clusters]]
name = "upgrader"
endpoints = ["127.0.0.1:{upgrader}"]

[[clusters]]
name = "latestart"
endpoints = ["127.0.0.1:{latestart}"]
protocol = "h2"

[[clusters]]
name = "fresh"
endpoints = ["127.0.0.1:{fresh}"]
protocol = "h2"

[[clusters]]
name = "hostile"
endpoints = ["127.0.0.1:{hostile}"]
protocol = "h2"

[[routes]]
name = "h2up"
match = { host = "{h2up_host}" }
cluster = "h2up"

[[routes]]
name = "upgrader"
match = { host = "upgrade.test" }
cluster = "upgrader"

[[routes]]
name = "narrow"
match = { host = "narrow.test" }
cluster = "narrow"

[[routes]]
name = "latestart"
match = { host = "latestart.test" }
cluster = "latestart"

[[routes]]
name = "fresh"
match = { host = "fresh.test" }
cluster = "fresh"

[[routes]]
name = "trailers"
match = { host = "trailers.test" }
cluster = "fresh"
model = "m-1"
request_headers_add = { "x-tenant" = "acme" }
request_headers_remove = ["x-internal"]

[[routes]]
name = "hostile"
match = { host = "hostile.test" }
cluster = "hostile"

[[routes]]
name = "all"
cluster = "demo"
"""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def h2up() -> Iterator[H2Upstream]:
    up = H2Upstream(name="h2-upstream")
    yield up
    up.stop()


@pytest.fixture(scope="module")
def narrow() -> Iterator[H2Upstream]:
    """An h2 upstream that allows 2 concurrent streams per connection."""
    up = H2Upstream(name="narrow", max_streams=2)
    yield up
    up.stop()


class UpgradeUpstream(socketserver.ThreadingTCPServer):
    """An HTTP/1.1 upstream that accepts `Upgrade: h2c` (101, then raw bytes: what an h2c
    server behind a proxy that tunnels the upgrade would speak to the client directly);
    GET /force101 gets a 101 whatever the request said."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        super().__init__(("127.0.0.1", 0), self._Handler)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()

    class _Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            sock = self.request
            sock.settimeout(5)
            head = b""
            while b"\r\n\r\n" not in head:
                data = sock.recv(65536)
                if not data:
                    return
                head += data
            if b"transfer-encoding: chunked" in head.lower():
                # Keep the whole chunked body, up to the end of its trailer section.
                while not (b"\r\n0\r\n" in head and head.endswith(b"\r\n\r\n")):
                    data = sock.recv(65536)
                    if not data:
                        return
                    head += data
            self.server.heads.append(head)
            if head.startswith(b"GET /websocket101 "):
                sock.sendall(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                             b"Upgrade: WebSocket\r\nContent-Length: 0\r\n\r\nTUNNEL")
                time.sleep(0.5)
            elif b"upgrade: h2c" in head.lower() or head.startswith(b"GET /force101 "):
                sock.sendall(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                             b"Upgrade: h2c\r\n\r\nSMUGGLED")
                time.sleep(0.5)
            else:
                sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nplain")


@pytest.fixture(scope="module")
def upgrader() -> Iterator[UpgradeUpstream]:
    server = UpgradeUpstream()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def latestart() -> Iterator[H2Upstream]:
    """An h2 upstream that sends its SETTINGS 600 ms after accepting a connection."""
    up = H2Upstream(name="latestart", settings_delay=0.6)
    yield up
    up.stop()


@pytest.fixture(scope="module")
def fresh() -> Iterator[H2Upstream]:
    """An h2 upstream for uploads: no /stall test has used up its connection's window."""
    up = H2Upstream(name="fresh")
    yield up
    up.stop()


@pytest.fixture(scope="module")
def hostile() -> Iterator[H2Upstream]:
    """An h2 upstream for the flood tests, which cost it its connections."""
    up = H2Upstream(name="hostile")
    yield up
    up.stop()


@pytest.fixture(scope="module")
def proxy(demo_upstream: int, h2up: H2Upstream, narrow: H2Upstream, pki: Pki,
          upgrader: UpgradeUpstream, latestart: H2Upstream, fresh: H2Upstream,
          hostile: H2Upstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProc]:
    text = CONFIG
    for key, value in {"cert": pki.cert, "key": pki.key, "ca": pki.ca, "demo": demo_upstream,
                       "h2up": h2up.port, "h2up_host": H2UP_HOST,
                       "narrow": narrow.port, "upgrader": upgrader.port,
                       "latestart": latestart.port, "fresh": fresh.port,
                       "hostile": hostile.port}.items():
        text = text.replace("{" + key + "}", str(value))
    p = ProxyProc(tmp_path_factory.mktemp("h2-clients"), text,
                  ("h2c", "mixed", "h1", "tls", "mtls"))
    yield p
    p.stop()


def url(proxy: ProxyProc, listener: str, path: str) -> str:
    scheme = "https" if listener in ("tls", "mtls") else "http"
    return f"{scheme}://127.0.0.1:{proxy.ports[listener]}{path}"


def run(*args: str, timeout: float = 60, stdin: Any = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, timeout=timeout, check=False,
                          stdin=stdin)


def curl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return run("curl", "-sS", "--max-time", str(int(timeout)), *args, timeout=timeout + 10)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- h2load -----------------------------------------------------------------------------------


def h2load(target: str, *extra: str, n: int = 2000) -> str:
    res = run("h2load", "-n", str(n), "-c", "4", "-m", "16", *extra, target, timeout=60)
    out = res.stdout.decode()
    assert res.returncode == 0, out + res.stderr.decode()
    m = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, "
                  r"(\d+) failed, (\d+) errored, (\d+) timeout", out)
    assert m, out
    total, started, done, ok, failed, errored, timeouts = map(int, m.groups())
    assert (total, done, ok, failed, errored, timeouts) == (n, n, n, 0, 0, 0), out
    assert re.search(rf"status codes: {n} 2xx, 0 3xx, 0 4xx, 0 5xx", out), out
    return out


@pytest.mark.parametrize("listener", ["h2c", "mixed", "tls"])
def test_h2load(proxy: ProxyProc, listener: str) -> None:
    out = h2load(url(proxy, listener, "/bytes/4096"))
    assert "Application protocol: h2" in out or "Application protocol: h2c" in out, out
    # 2000 responses x 4096 bytes of data, no more no less.
    m = re.search(r"traffic: .*\((\d+)\) data", out)
    assert m and int(m.group(1)) == 2000 * 4096, out


def test_h2load_uploads(proxy: ProxyProc, tmp_path: Path) -> None:
    body = tmp_path / "body"
    body.write_bytes(BLOCK * 2)
    h2load(url(proxy, "h2c", "/echo"), "-d", str(body), n=500)


# -- nghttp -----------------------------------------------------------------------------------


# -c 0: a header table of 0; with -u nghttp states it twice (HTTP2-Settings, then its
# preface SETTINGS), which lost the proxy's table size update (COMPRESSION_ERROR).
@pytest.mark.parametrize("listener,flags", [("h2c", ()), ("mixed", ()), ("mixed", ("-u",)),
                                            ("mixed", ("-u", "-c", "0")), ("h2c", ("-c", "0")),
                                            ("tls", ())])
def test_nghttp_download_integrity(proxy: ProxyProc, listener: str, flags: tuple) -> None:
    n = 3 * MiB + 12345
    res = run("nghttp", *flags, url(proxy, listener, f"/bytes/{n}"))
    assert res.returncode == 0, res.stderr.decode()
    assert len(res.stdout) == n and sha(res.stdout) == bytes_sha256(n)


def test_nghttp_upload_integrity(proxy: ProxyProc, tmp_path: Path) -> None:
    data = BLOCK * 40 + b"tail"
    path = tmp_path / "up"
    path.write_bytes(data)
    res = run("nghttp", "-d", str(path), url(proxy, "tls", "/echo"))
    assert res.returncode == 0, res.stderr.decode()
    doc = json.loads(res.stdout)
    assert doc["body_bytes"] == len(data) and doc["body_sha256"] == sha(data)
    assert doc["method"] == "POST"
    assert doc["headers"]["x-forwarded-proto"] == "https"


def test_nghttp_concurrent_streams(proxy: ProxyProc) -> None:
    """Several streams on one connection (nghttp -m), each body intact."""
    res = run("nghttp", "-m", "20", "-s", url(proxy, "h2c", "/bytes/200000"))
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout.count(b"\x00\x01\x02") >= 20  # the pattern, 20 times over


# -- curl --------------------------------------------------------------------------------------


def curl_get(*args: str) -> tuple[bytes, str]:
    """(body, http_version) of a curl GET; body and the version are split by a marker."""
    res = curl("-w", "\n@@%{http_version} %{http_code}", *args)
    assert res.returncode == 0, res.stderr.decode()
    body, _, tail = res.stdout.rpartition(b"\n@@")
    version, code = tail.decode().split()
    assert code == "200", (code, body[:300])
    return body, version


def test_curl_http2_upgrade(proxy: ProxyProc) -> None:
    n = MiB + 7
    body, version = curl_get("--http2", url(proxy, "mixed", f"/bytes/{n}"))
    assert version == "2" and sha(body) == bytes_sha256(n)


def test_curl_http2_upgrade_with_body_stays_http11(proxy: ProxyProc) -> None:
    """The proxy upgrades only bodyless requests; one with a body is answered in HTTP/1.1."""
    data = b"z" * 100000
    proc = subprocess.run(["curl", "-sS", "--http2", "--data-binary", "@-", "-w",
                           "\n@@%{http_version}", url(proxy, "mixed", "/echo")],
                          input=data, capture_output=True, timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    body, _, version = proc.stdout.rpartition(b"\n@@")
    doc = json.loads(body)
    assert doc["body_sha256"] == sha(data)
    assert version in (b"1.1", b"2")


@pytest.mark.parametrize("listener", ["h2c", "mixed"])
def test_curl_http2_prior_knowledge(proxy: ProxyProc, listener: str, tmp_path: Path) -> None:
    n = 2 * MiB + 1
    body, version = curl_get("--http2-prior-knowledge", url(proxy, listener, f"/bytes/{n}"))
    assert version == "2" and sha(body) == bytes_sha256(n)
    data = BLOCK * 16 + b"end"
    path = tmp_path / "up"
    path.write_bytes(data)
    body, version = curl_get("--http2-prior-knowledge", "--data-binary", f"@{path}",
                             url(proxy, listener, "/echo"))
    doc = json.loads(body)
    assert version == "2" and doc["body_sha256"] == sha(data) and doc["body_bytes"] == len(data)


@pytest.mark.parametrize("flag,expect", [("--http2", "2"), ("--http1.1", "1.1")])
def test_curl_tls_alpn(proxy: ProxyProc, pki: Pki, flag: str, expect: str) -> None:
    n = 500000
    body, version = curl_get(flag, "-k", url(proxy, "tls", f"/bytes/{n}"))
    assert version == expect and sha(body) == bytes_sha256(n)
    body, version = curl_get(flag, "--cacert", str(pki.ca), url(proxy, "tls", "/echo"))
    doc = json.loads(body)
    assert version == expect
    assert doc["headers"]["x-forwarded-proto"] == "https"


# -- httpx -------------------------------------------------------------------------------------


def test_httpx_http2_tls(proxy: ProxyProc, pki: Pki) -> None:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    with httpx.Client(http2=True, verify=ctx, timeout=30) as client:
        for n in (0, 1, 65535, 65536, 1000000):
            r = client.get(url(proxy, "tls", f"/bytes/{n}"))
            assert r.status_code == 200 and r.http_version == "HTTP/2"
            assert sha(r.content) == bytes_sha256(n)
        data = BLOCK * 3
        r = client.post(url(proxy, "tls", "/echo"), content=data)
        assert r.http_version == "HTTP/2" and r.json()["body_sha256"] == sha(data)
        with client.stream("GET", url(proxy, "tls", "/sse?n=3&delay_ms=100")) as resp:
            events = [line for line in resp.iter_lines() if line]
        assert events == ["data: event 0", "data: event 1", "data: event 2"]


def test_httpx_http2_prior_knowledge_concurrent(proxy: ProxyProc) -> None:
    """Many requests at once over one h2c connection: none gets another's body."""

    async def main() -> list[Any]:
        async with httpx.AsyncClient(http1=False, http2=True, timeout=30) as client:
            return await asyncio.gather(*[
                client.post(url(proxy, "h2c", f"/echo/{i}"), content=str(i).encode() * i)
                for i in range(1, 33)], return_exceptions=True)

    results = asyncio.run(main())
    for i, r in enumerate(results, 1):
        assert isinstance(r, httpx.Response), (i, r)
        doc = r.json()
        assert r.http_version == "HTTP/2" and doc["path"] == f"/echo/{i}"
        assert doc["body_sha256"] == sha(str(i).encode() * i)


def test_h2_client_cannot_state_the_proxy_fields(proxy: ProxyProc) -> None:
    """x-aiproxy-* (and the CGI spelling x_aiproxy_*) are the proxy's to send upstream:
    an HTTP/2 client's are dropped, as an HTTP/1.1 client's are."""
    own = {"x-aiproxy-identity": "subject=root", "x-aiproxy-intent": "transfer",
           "x_aiproxy_policy": "allow", "x-aiproxy-": "bare"}
    with httpx.Client(http1=False, http2=True, timeout=30) as client:
        r = client.get(url(proxy, "h2c", "/echo/own"), headers={**own, "x-aiproxyz": "kept"})
    seen = r.json()["headers"]
    assert r.http_version == "HTTP/2" and not set(own) & set(seen), seen
    assert seen["x-aiproxyz"] == "kept"


# -- mTLS ---------------------------------------------------------------------------------------


def test_mtls_client_certificate_required(proxy: ProxyProc, pki: Pki) -> None:
    target = url(proxy, "mtls", "/echo")
    body, version = curl_get("--http2", "--cacert", str(pki.ca), "--cert", str(pki.client_cert),
                             "--key", str(pki.client_key), target)
    assert version == "2" and json.loads(body)["method"] == "GET"
    # No certificate, or one from another CA: the handshake fails, no HTTP response.
    for extra in ((), ("--cert", str(pki.other_client_cert), "--key",
                       str(pki.other_client_key))):
        res = curl("--http2", "--cacert", str(pki.ca), "-w", "%{http_code}", *extra, target,
                   timeout=10)
        assert res.returncode != 0 and res.stdout in (b"", b"000"), (extra, res)


def test_mtls_handshake_fails_without_certificate(proxy: ProxyProc, pki: Pki) -> None:
    """Python's ssl client: without a certificate the server aborts the handshake (TLS 1.3
    reports it at the first read); with one, HTTP/2 works."""
    frames: list[Any] = []
    try:
        with FrameClient(proxy.ports["mtls"], tls=client_tls(pki)) as c:
            c.handshake()
            c.send(c.request(1, "/echo"))
            frames = c.frames_until(lambda f: False, 5)  # everything, up to EOF
            assert c.eof, "connection still open without a client certificate"
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        pass  # the alert arrived while writing
    assert frames == [], f"served without a client certificate: {frames}"
    with FrameClient(proxy.ports["mtls"],
                     tls=client_tls(pki, cert=(pki.client_cert, pki.client_key))) as c:
        c.handshake()
        c.send(c.request(1, "/echo"))
        assert c.response(1).status == 200


# -- translation: HTTP/2 client -> HTTP/1.1 upstream ----------------------------------------------


CONNECTION_SPECIFIC = {b"connection", b"keep-alive", b"transfer-encoding", b"upgrade",
                       b"proxy-connection"}


@pytest.mark.parametrize("query", ["", "?length=1"])
def test_h2_client_h1_upstream_framing(proxy: ProxyProc, query: str) -> None:
    n = 300001
    resp = h2_get(proxy.ports["h2c"], f"/bytes/{n}{query}")
    assert resp.status == 200 and sha(resp.body) == bytes_sha256(n)
    names = {k for k, _ in resp.headers}
    assert not names & CONNECTION_SPECIFIC, resp.headers  # RFC 9113 8.2.2
    if query:
        assert resp.header(b"content-length") == str(n).encode()


def test_h2_head_and_no_body_statuses(proxy: ProxyProc) -> None:
    with FrameClient(proxy.ports["h2c"]) as c:
        c.handshake()
        c.send(c.request(1, "/bytes/1000?length=1", "HEAD"), c.request(3, "/status/204"),
               c.request(5, "/status/304"))
        head, s204, s304 = c.response(1), c.response(3), c.response(5)
    assert head.status == 200 and head.body == b"" and head.header(b"content-length") == b"1000"
    assert s204.status == 204 and s204.body == b""
    assert s304.status == 304 and s304.body == b""


def test_h2_sse_event_by_event(proxy: ProxyProc) -> None:
    with FrameClient(proxy.ports["h2c"]) as c:
        c.handshake()
        start = time.monotonic()
        c.send(c.request(1, "/sse?n=4&delay_ms=300"))
        arrivals = []
        while True:
            f = c.recv(5)
            assert f is not None, "stream stalled"
            if isinstance(f, DataFrame) and f.stream_id == 1:
                if f.data:
                    arrivals.append((time.monotonic() - start, f.data))
                if "END_STREAM" in f.flags:
                    break
    events = b"".join(d for _, d in arrivals)
    assert events == b"".join(f"data: event {i}\n\n".encode() for i in range(4))
    assert arrivals[0][0] < 0.6, arrivals  # the whole stream takes 0.9 s
    assert arrivals[-1][0] > 0.8, arrivals
    assert len(arrivals) >= 4


def test_h2_100mib_download_bounded_memory(proxy: ProxyProc) -> None:
    n = 100 * MiB
    digest = hashlib.sha256()
    total = 0
    with RssMonitor(proxy.pid) as rss:
        with subprocess.Popen(["curl", "-sS", "--http2-prior-knowledge", "--max-time", "60",
                               url(proxy, "h2c", f"/bytes/{n}")], stdout=subprocess.PIPE) as proc:
            while chunk := proc.stdout.read(1 << 20):
                digest.update(chunk)
                total += len(chunk)
            assert proc.wait(60) == 0
    assert total == n and digest.hexdigest() == bytes_sha256(n)
    assert rss.growth < 32 * MiB, rss.describe()


def test_h2_100mib_upload_bounded_memory(proxy: ProxyProc, tmp_path: Path) -> None:
    n = 100 * MiB
    path = tmp_path / "big"
    with path.open("wb") as f:
        for _ in range(n // len(BLOCK)):
            f.write(BLOCK)
    with RssMonitor(proxy.pid) as rss:
        body, version = curl_get("--http2-prior-knowledge", "--data-binary", f"@{path}",
                                 url(proxy, "h2c", "/echo"))
    doc = json.loads(body)
    assert version == "2" and doc["body_bytes"] == n and doc["body_sha256"] == bytes_sha256(n)
    assert rss.growth < 32 * MiB, rss.describe()


# -- translation: HTTP/1.1 client -> HTTP/2 upstream ----------------------------------------------


def test_h1_client_h2_upstream_get(proxy: ProxyProc, h2up: H2Upstream) -> None:
    n = 300001
    for query, framing in (("", "transfer-encoding: chunked"),
                           ("?length=1", f"content-length: {n}")):
        res = curl("-D", "-", "-H", f"Host: {H2UP_HOST}", url(proxy, "h1", f"/bytes/{n}{query}"))
        assert res.returncode == 0, res.stderr.decode()
        head, _, body = res.stdout.partition(b"\r\n\r\n")
        lines = head.decode().lower().split("\r\n")
        assert lines[0] == "http/1.1 200 ok", head
        assert framing in lines, head
        assert sha(body) == bytes_sha256(n)
    # The h2 upstream saw a proper HTTP/2 request.
    req = [ev for ev in h2up.events if ev[1] == "request"][-1][3]
    fields = dict(req)
    assert fields[b":method"] == b"GET" and fields[b":authority"] == H2UP_HOST.encode()
    assert fields[b":scheme"] == b"http" and b"host" not in fields
    assert not set(fields) & CONNECTION_SPECIFIC


@pytest.mark.parametrize("chunked", [False, True])
def test_h1_client_h2_upstream_upload(proxy: ProxyProc, tmp_path: Path, chunked: bool) -> None:
    data = BLOCK * 20 + b"x" * 17
    path = tmp_path / "up"
    path.write_bytes(data)
    extra = ("-H", "Transfer-Encoding: chunked") if chunked else ()
    res = curl("-H", f"Host: {H2UP_HOST}", *extra, "--data-binary", f"@{path}",
               url(proxy, "h1", "/echo"))
    assert res.returncode == 0, res.stderr.decode()
    doc = json.loads(res.stdout)
    assert doc["upstream"] == "h2-upstream" and doc["method"] == "POST"
    assert doc["body_bytes"] == len(data) and doc["body_sha256"] == sha(data)


@pytest.mark.parametrize("fields", [
    b"Content-Length: 5, 5\r\n", b"Content-Length: 5,5 ,5\r\n",
    b"Content-Length: 5\r\ncontent-length: 5\r\n", b"Content-Length: 005\r\n"],
    ids=["list", "list-spaced", "repeated", "leading-zeros"])
def test_h1_client_h2_upstream_content_length_canonical(proxy: ProxyProc,
                                                        h2up: H2Upstream,
                                                        fields: bytes) -> None:
    """Content-Length forms the proxy takes as 5 (RFC 9110 8.6: a list of one value, or
    repeated fields) reach an HTTP/2 upstream as one content-length: 5, as they reach an
    HTTP/1.1 one: the raw list is malformed there (RFC 9113 8.1.1), and a server may
    fail the whole connection over it."""
    target = "/echo?cl=" + fields.hex()
    req = (f"POST {target} HTTP/1.1\r\nHost: {H2UP_HOST}\r\nConnection: close\r\n".encode()
           + fields + b"\r\nhello")
    raw = raw_exchange(proxy.ports["h1"], req)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), raw[:300]
    assert json.loads(body)["body_bytes"] == 5
    [sent] = [ev[3] for ev in h2up.events
              if ev[1] == "request" and (b":path", target.encode()) in ev[3]]
    assert [v for n, v in sent if n == b"content-length"] == [b"5"]


def test_h1_client_h2_upstream_trailers(proxy: ProxyProc) -> None:
    """Upstream trailers reach an HTTP/1.1 client that said TE: trailers (chunked trailer
    section), and only then."""
    req = (f"GET /trailers HTTP/1.1\r\nHost: {H2UP_HOST}\r\nTE: trailers\r\n"
           f"Connection: close\r\n\r\n").encode()
    raw = raw_exchange(proxy.ports["h1"], req)
    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
    assert b"body-before-trailers" in raw
    assert raw.endswith(b"0\r\nx-trailer: t1\r\nx-other: t2\r\n\r\n"), raw[-200:]
    raw = raw_exchange(proxy.ports["h1"], req.replace(b"TE: trailers\r\n", b""))
    assert raw.endswith(b"\r\n0\r\n\r\n"), raw[-200:]


def test_h1_client_h2_upstream_statuses_and_head(proxy: ProxyProc) -> None:
    res = curl("-o", "/dev/null", "-w", "%{http_code}", "-H", f"Host: {H2UP_HOST}",
               url(proxy, "h1", "/status/204"))
    assert res.stdout == b"204"
    res = curl("-I", "-H", f"Host: {H2UP_HOST}", url(proxy, "h1", "/bytes/1000?length=1"))
    assert res.returncode == 0 and b"content-length: 1000" in res.stdout.lower()


@pytest.mark.parametrize("status", [204, 304])
def test_h2_upstream_content_on_204_or_304_is_not_forwarded(proxy: ProxyProc,
                                                            status: int) -> None:
    """RFC 9110 6.4.1: a 204 or 304 ends with its head. DATA an HTTP/2 upstream sends
    after it is not passed on, so the next response on the client's connection is the
    next response, not bytes the upstream chose."""
    req = (f"GET /status-with-body/{status} HTTP/1.1\r\nHost: {H2UP_HOST}\r\n\r\n"
           f"GET /echo/next HTTP/1.1\r\nHost: {H2UP_HOST}\r\nConnection: close\r\n\r\n")
    raw = raw_exchange(proxy.ports["h1"], req.encode())
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), raw[:300]
    assert b"transfer-encoding" not in head.lower() and b"X-Injected" not in raw, raw[:500]
    assert rest.startswith(b"HTTP/1.1 200 OK"), raw[:500]
    assert b'"path": "/echo/next"' in rest


def test_h2_upstream_status_out_of_range_is_502(proxy: ProxyProc) -> None:
    res = curl("-o", "/dev/null", "-w", "%{http_code}", "-H", f"Host: {H2UP_HOST}",
               url(proxy, "h1", "/status/600"))
    assert res.stdout == b"502"


@pytest.mark.parametrize("kind", ["ping", "settings", "empty_data", "priority",
                                  "window_update", "unknown"])
def test_h2_upstream_flood_is_cut(proxy: ProxyProc, hostile: H2Upstream, kind: str) -> None:
    """An upstream that floods frames carrying no response (20,000 of them) overdraws the
    connection's frame budgets: the proxy says so and closes the connection (GOAWAY), and
    the request fails (a 502, or a cut response where the head had gone out)."""
    what = {"ping": "floods PING frames", "settings": "floods SETTINGS frames"}.get(
        kind, "floods frames that carry no response")
    before = proxy.log().count(what)

    def lost() -> int:
        return sum(1 for ev in list(hostile.events) if ev[1] == "lost")

    closed = lost()
    raw = raw_exchange(proxy.ports["h1"], f"GET /flood/{kind} HTTP/1.1\r\n"
                       "Host: hostile.test\r\nConnection: close\r\n\r\n".encode())
    assert b"the flood went unnoticed" not in raw
    if kind == "empty_data" and raw.startswith(b"HTTP/1.1 200 "):
        pass  # the head had gone out before the flood arrived: the response is cut
    else:
        assert raw.startswith(b"HTTP/1.1 502 "), raw[:300]
        assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["code"] == \
            "upstream_bad_response"
    assert wait_for(lambda: proxy.log().count(what) > before, 5), proxy.log()[-2000:]
    assert wait_for(lambda: lost() > closed, 5)
    res = curl("-H", "Host: hostile.test", url(proxy, "h1", "/echo/after"))
    assert json.loads(res.stdout)["path"] == "/echo/after"


def test_h2_upstream_token_stream_in_small_frames_is_not_a_flood(proxy: ProxyProc) -> None:
    """A token stream's frames are small but carry the response: 5,000 DATA frames of 6
    bytes each reach the client whole."""
    floods = proxy.log().count("floods")
    res = curl("-H", "Host: hostile.test", url(proxy, "h1", "/tokens/5000"))
    assert res.returncode == 0, res.stderr
    assert res.stdout == b"".join(b"tok%03d" % (i % 1000) for i in range(5000))
    assert proxy.log().count("floods") == floods


def test_h1_clients_share_one_upstream_h2_connection(proxy: ProxyProc,
                                                     h2up: H2Upstream) -> None:
    before = h2up.connections
    errors: list[Any] = []

    def fetch(i: int) -> None:
        try:
            with httpx.Client(timeout=30) as client:
                for j in range(5):
                    r = client.get(url(proxy, "h1", f"/echo/{i}/{j}"),
                                   headers={"host": H2UP_HOST})
                    assert r.status_code == 200 and r.json()["path"] == f"/echo/{i}/{j}"
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=fetch, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    # 80 requests, 16 at a time: multiplexed over the connection(s) already open (at most
    # one new one, if this is the first test to use the upstream).
    assert h2up.connections - before <= 1


# -- RST_STREAM both ways -------------------------------------------------------------------------


def test_upstream_reset_reaches_h2_client(proxy: ProxyProc) -> None:
    with FrameClient(proxy.ports["h2c"]) as c:
        c.handshake()
        c.send(c.request(1, "/reset-after-head", authority=H2UP_HOST),
               c.request(3, "/reset-before-head", authority=H2UP_HOST))
        after, before = c.response(1), c.response(3)
    # Mid-response: the client must learn the body is incomplete: RST_STREAM.
    assert after.status == 200 and after.reset is not None and after.body == b"partial body"
    # Before the head: the proxy's own 502.
    assert before.status == 502 and before.reset is None
    assert json.loads(before.body)["error"]["code"]


def test_upstream_reset_reaches_h1_client(proxy: ProxyProc) -> None:
    raw = raw_exchange(proxy.ports["h1"], f"GET /reset-after-head HTTP/1.1\r\nHost: {H2UP_HOST}\r\n"
                 f"\r\n".encode())
    assert raw.startswith(b"HTTP/1.1 200") and b"partial body" in raw
    assert not raw.endswith(b"0\r\n\r\n"), "a reset response must not look complete"


def test_client_reset_reaches_h2_upstream(proxy: ProxyProc, h2up: H2Upstream) -> None:
    start = time.monotonic()
    with FrameClient(proxy.ports["h2c"]) as c:
        c.handshake()
        c.send(c.request(1, "/hang", authority=H2UP_HOST))
        assert wait_for(lambda: any(ev[1] == "request" and ev[0] >= start
                                    and dict(ev[3]).get(b":path") == b"/hang"
                                    for ev in h2up.events), 5)
        c.send(RstStreamFrame(1, error_code=8))
        assert wait_for(lambda: any(ev[1] == "reset" and ev[0] >= start
                                    for ev in h2up.events), 5), h2up.events
        c.send(c.request(3, "/echo"))
        assert c.response(3).status == 200


def test_trailers_h2_upstream_to_h2_client(proxy: ProxyProc) -> None:
    with FrameClient(proxy.ports["h2c"]) as c:
        c.handshake()
        c.send(c.request(1, "/trailers", extra=[("te", "trailers")], authority=H2UP_HOST))
        resp = c.response(1)
    assert resp.status == 200 and resp.body == b"body-before-trailers"
    assert resp.trailers == [(b"x-trailer", b"t1"), (b"x-other", b"t2")]


def test_h2_pool_opens_connections_past_the_peer_stream_limit(proxy: ProxyProc,
                                                             narrow: H2Upstream) -> None:
    """The upstream allows 2 streams per connection; 12 requests at once must all be
    served (the pool opens more connections) rather than refused."""
    results: list[Any] = []
    # Clients made first and released together: making 12 (each loads a CA bundle) can
    # take longer than a request on a busy machine, and then fewer are in flight at once.
    clients = [httpx.Client(timeout=30) for _ in range(12)]
    start = threading.Barrier(12)

    def fetch(client: httpx.Client) -> None:
        try:
            with client:
                start.wait(10)
                r = client.get(url(proxy, "h1", "/sleep/400"), headers={"host": "narrow.test"})
                results.append(r.status_code)
        except Exception as exc:
            results.append(exc)

    threads = [threading.Thread(target=fetch, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [200] * 12, results
    assert narrow.connections >= 6, narrow.connections


def test_h2_client_not_reading_h2_upstream_memory_bounded(proxy: ProxyProc) -> None:
    """HTTP/2 on both sides, a client that never opens its window: the proxy stops
    acknowledging the upstream's DATA, so neither it nor anything else buffers 1 GiB."""
    with FrameClient(proxy.ports["h2c"]) as c:
        c.handshake()
        c.send(c.request(1, "/bytes/1073741824", authority=H2UP_HOST))
        with RssMonitor(proxy.pid) as rss:
            assert stops_reading(proxy.pid), "the proxy never stopped reading the upstream"
            assert h2_get(proxy.ports["h2c"], "/echo").status == 200
        got = sum(len(f.data) for f in c.frames_until(lambda f: False, 0.5)
                  if isinstance(f, DataFrame))
    assert got <= 65535
    assert rss.growth < 16 * MiB, rss.describe()


@pytest.mark.parametrize("listener", ["h2c", "h1"])
def test_upload_to_stalled_h2_upstream_memory_bounded(proxy: ProxyProc, h2up: H2Upstream,
                                                      tmp_path: Path, listener: str) -> None:
    """An HTTP/2 upstream that never acknowledges request DATA: the proxy must stop
    reading the client (HTTP/1.1) or stop granting it window (HTTP/2), not buffer."""
    path = tmp_path / "big"
    with path.open("wb") as f:
        for _ in range(64 * MiB // len(BLOCK)):
            f.write(BLOCK)
    start = time.monotonic()
    flag = "--http2-prior-knowledge" if listener == "h2c" else "--http1.1"
    with RssMonitor(proxy.pid) as rss:
        res = curl(flag, "-H", f"Host: {H2UP_HOST}", "--data-binary", f"@{path}",
                   url(proxy, listener, "/stall"), timeout=3)
    assert res.returncode == 28, res  # curl's timeout: the upload never completes
    received = sum(ev[3] for ev in h2up.events if ev[1] == "data" and ev[0] >= start)
    assert received <= 65535, received  # the upstream's window, nothing more
    assert rss.growth < 16 * MiB, rss.describe()


def _stalled_upstream_streams(up: H2Upstream, path: bytes) -> dict[int, bool]:
    """Per open stream of `path` on the upstream (any of its connections): whether its
    sender waits for that stream's own window (read in the upstream's thread)."""
    def look() -> dict[int, bool]:
        found = {}
        for proto in up.protocols:
            for sid, head in proto.heads.items():
                stream = proto.conn.streams.get(sid)
                if dict(head).get(b":path") == path and stream is not None and not stream.closed:
                    found[id(proto) << 32 | sid] = stream.outbound_flow_control_window <= 0
        return found

    async def call() -> dict[int, bool]:
        return look()
    return asyncio.run_coroutine_threadsafe(call(), up.loop).result(10)


def test_stalled_streams_do_not_block_the_shared_upstream_connection(
        proxy: ProxyProc, h2up: H2Upstream) -> None:
    """Streams of many clients share one upstream HTTP/2 connection. Clients that stop
    reading must hold back only their own streams: if their unread data kept the shared
    connection's window closed, every other client of that upstream would hang. Once
    the upstream has used up the stream windows of all the stalled ones, another
    client's response completes whole while they are all still stalled."""
    huge = b"/bytes/1073741824"
    before = set(_stalled_upstream_streams(h2up, huge))  # left by earlier tests, if any

    def stalled() -> list[bool]:
        return [waits for key, waits in _stalled_upstream_streams(h2up, huge).items()
                if key not in before]

    clients = []
    try:
        for _ in range(16):
            c = FrameClient(proxy.ports["h2c"])
            c.handshake()
            c.send(c.request(1, huge.decode(), authority=H2UP_HOST))
            clients.append(c)
        # Each has its first 64 KiB (its window) and reads nothing more.
        for c in clients:
            assert c.frames_until(lambda f: isinstance(f, DataFrame), 5)
        assert wait_for(lambda: stalled() == [True] * 16, 30), stalled()
        with RssMonitor(proxy.pid) as rss:
            with FrameClient(proxy.ports["h2c"], timeout=60) as c:
                c.handshake()
                c.send(c.request(1, "/bytes/3000000", authority=H2UP_HOST))
                resp = c.response(1, timeout=60)  # a hang guard only
        assert resp.status == 200 and sha(resp.body) == bytes_sha256(3000000)
        assert stalled() == [True] * 16
        assert rss.growth < 64 * MiB, rss.describe()
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("listener,body", [("h1", b""), ("mixed", b"x" * 10)])
def test_h2c_upgrade_never_forwarded(proxy: ProxyProc, upgrader: UpgradeUpstream,
                                     listener: str, body: bytes) -> None:
    """h2c smuggling: a proxy that passes `Upgrade: h2c` on and tunnels the upstream's 101
    hands the client a raw HTTP/2 connection to the upstream, past routing and policy.
    The proxy either upgrades itself (bodyless, h2c listener) or strips the token."""
    before = len(upgrader.heads)
    req = (b"POST /x HTTP/1.1\r\nHost: upgrade.test\r\nConnection: Upgrade, HTTP2-Settings\r\n"
           b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\nContent-Length: %d\r\n"
           b"Connection: close\r\n\r\n%s" % (len(body), body))
    raw = raw_exchange(proxy.ports[listener], req)
    assert raw.startswith(b"HTTP/1.1 200"), raw[:300]
    assert b"SMUGGLED" not in raw
    seen = [h for h in upgrader.heads[before:] if h.startswith(b"POST /x ")]
    assert len(seen) == 1 and b"h2c" not in seen[0].lower(), seen


def _settings64(*pairs: tuple[int, int]) -> bytes:
    raw = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in pairs)
    return base64.urlsafe_b64encode(raw).rstrip(b"=")


@pytest.mark.parametrize("fields", [
    b"HTTP2-Settings: " + _settings64((2, 2)) + b"\r\n",  # ENABLE_PUSH 2
    b"HTTP2-Settings: " + _settings64((4, 2**31)) + b"\r\n",  # window over 2^31-1
    b"HTTP2-Settings: " + _settings64((5, 100)) + b"\r\n",  # MAX_FRAME_SIZE under 16384
    b"HTTP2-Settings: " + _settings64((9, 2)) + b"\r\n",  # NO_RFC7540_PRIORITIES 2
    b"HTTP2-Settings: AAMAAABk***\r\n",  # not base64url
    b"HTTP2-Settings: AAMAAABkAAQAAP__\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n",
], ids=["enable_push_2", "window_too_big", "frame_size_too_small", "priorities_2",
        "not_base64url", "two_fields"])
def test_h2c_upgrade_with_bad_settings_stays_http11(proxy: ProxyProc, fields: bytes) -> None:
    """RFC 7540 3.2.1: exactly one HTTP2-Settings field, holding a valid SETTINGS
    payload; otherwise the request is answered over HTTP/1.1, not upgraded."""
    req = (b"GET /echo HTTP/1.1\r\nHost: upgrade.test\r\nConnection: Upgrade, HTTP2-Settings, "
           b"close\r\nUpgrade: h2c\r\n" + fields + b"\r\n")
    raw = raw_exchange(proxy.ports["mixed"], req)
    assert raw.startswith(b"HTTP/1.1 200"), raw[:300]
    good = req.replace(fields, b"HTTP2-Settings: " + _settings64((3, 100)) + b"\r\n")
    assert raw_exchange(proxy.ports["mixed"], good, until=b"\r\n\r\n").startswith(
        b"HTTP/1.1 101")


def test_h2c_upgrade_needs_http2_settings_named_in_connection(
        proxy: ProxyProc, upgrader: UpgradeUpstream) -> None:
    """RFC 7540 3.2.1: HTTP2-Settings is a connection option; not named in Connection,
    the request stays HTTP/1.1, and the field (hop-by-hop either way) does not go on."""
    before = len(upgrader.heads)
    req = (b"GET /plain HTTP/1.1\r\nHost: upgrade.test\r\nConnection: Upgrade, close\r\n"
           b"Upgrade: h2c\r\nHTTP2-Settings: " + _settings64((3, 100)) + b"\r\n\r\n")
    raw = raw_exchange(proxy.ports["mixed"], req)
    assert raw.startswith(b"HTTP/1.1 200"), raw[:300]
    # Only this request's: an earlier test's upgraded request may still be on its way.
    seen = [h for h in upgrader.heads[before:] if h.startswith(b"GET /plain ")]
    assert len(seen) == 1 and b"http2-settings" not in seen[0].lower(), seen


def test_unsolicited_101_for_h2c_is_not_tunnelled(proxy: ProxyProc) -> None:
    req = (b"GET /force101 HTTP/1.1\r\nHost: upgrade.test\r\nConnection: Upgrade, close\r\n"
           b"Upgrade: h2c\r\n\r\n")
    raw = raw_exchange(proxy.ports["h1"], req)
    assert raw.startswith(b"HTTP/1.1 502"), raw[:300]
    assert b"SMUGGLED" not in raw


WEBSOCKET_UPGRADE = (b"Connection: Upgrade, close\r\nUpgrade: websocket\r\n"
                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                     b"Sec-WebSocket-Version: 13\r\n\r\n")


def test_101_to_a_protocol_the_client_did_not_offer_is_not_tunnelled(proxy: ProxyProc) -> None:
    """RFC 9110 7.8: the upstream may switch only to a protocol the client listed; else
    the client's next bytes would reach it raw, past routing and policy."""
    req = b"GET /force101 HTTP/1.1\r\nHost: upgrade.test\r\n" + WEBSOCKET_UPGRADE
    raw = raw_exchange(proxy.ports["h1"], req)
    assert raw.startswith(b"HTTP/1.1 502"), raw[:300]
    assert b"SMUGGLED" not in raw


def test_101_goes_to_the_client_without_content_length(proxy: ProxyProc) -> None:
    """The protocol name matches in any case; RFC 9110 8.6: no Content-Length on a 1xx."""
    req = b"GET /websocket101 HTTP/1.1\r\nHost: upgrade.test\r\n" + WEBSOCKET_UPGRADE
    raw = raw_exchange(proxy.ports["h1"], req)
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101"), raw[:300]
    assert b"content-length" not in head.lower() and rest == b"TUNNEL"


def test_complete_response_before_the_request_ends(proxy: ProxyProc) -> None:
    """RFC 9113 8.1: a response complete before the request may be followed by
    RST_STREAM(NO_ERROR), which some clients (httpcore) mishandle. Not when the whole
    declared body has arrived and only END_STREAM is still to come; yes when the upstream
    answered without reading the body. Either way the connection carries on."""
    with FrameClient(proxy.ports["h2c"]) as c:
        c.handshake()
        c.send(c.request(1, "/echo", "POST", [("content-length", "5")], end_stream=False),
               DataFrame(1, data=b"hello"))
        resp = c.response(1)
        assert resp.status == 200 and json.loads(resp.body)["body_bytes"] == 5
        assert resp.reset is None
        later = c.frames_until(lambda f: isinstance(f, RstStreamFrame), 0.5)
        assert not [f for f in later if isinstance(f, RstStreamFrame)], later
        c.send(DataFrame(1, data=b"", flags=["END_STREAM"]))

        c.send(c.request(3, "/status/201", "POST", [("content-length", "100")],
                         end_stream=False), DataFrame(3, data=b"12"))
        resp = c.response(3)
        assert resp.status == 201
        rst = c.frames_until(lambda f: isinstance(f, RstStreamFrame), 2)
        assert rst and rst[-1].stream_id == 3 and rst[-1].error_code == 0, rst

        c.send(c.request(5, "/echo"))
        assert c.response(5).status == 200


# -- request trailers and grpc-timeout ---------------------------------------------------------


def test_request_trailers_h2_client_to_h2_upstream(proxy: ProxyProc, tmp_path: Path) -> None:
    """nghttp sends a body and trailer fields; the h2 upstream gets both trailers. (Not
    h2up: the /stall tests leave its shared connection without window for bodies.)"""
    body = tmp_path / "body.bin"
    body.write_bytes(BLOCK[:3000])
    res = run("nghttp", "-d", str(body), "--trailer", "x-checksum: abc123",
              "--trailer", "x-count: 3", "-H", ":authority: fresh.test",
              url(proxy, "h2c", "/echo"))
    assert res.returncode == 0, res.stderr.decode()
    doc = json.loads(res.stdout)
    assert doc.get("body_bytes") == 3000, doc
    assert doc["trailers"] == [["x-checksum", "abc123"], ["x-count", "3"]]


def test_request_trailers_never_carry_what_the_proxy_states(proxy: ProxyProc) -> None:
    """A client's trailer fields cannot state what the proxy states or removes on the
    request (identity, forwarding, tracing, lineage, credentials, deadline, the route's
    fields): an upstream that merged trailers into the header section would believe
    them. A field of the client's own goes on."""
    forged = [("x-checksum", "abc"), ("x-aiproxy-identity", "subject=admin"),
              ("x_aiproxy_identity", "subject=admin"), ("traceparent", "00-" + "1" * 32
              + "-" + "2" * 16 + "-01"), ("tracestate", "a=b"), ("x-trace-id", "t"),
              ("x-forwarded-for", "1.2.3.4"), ("x_forwarded_for", "1.2.3.4"),
              ("x-forwarded-host", "evil.test"), ("forwarded", "for=1.2.3.4"),
              ("via", "1.1 evil"), ("x-model-id", "forged"), ("x-api-key", "k"),
              ("api-key", "k"), ("grpc-timeout", "1S"), ("proxy-x", "1"),
              ("x-tenant", "forged"), ("x-internal", "1"), ("content-type", "text/x")]
    with FrameClient(proxy.ports["h2c"]) as c:
        c.handshake()
        c.send(c.request(1, "/echo", "POST", authority="trailers.test", end_stream=False),
               DataFrame(1, data=b"abc"), c.headers(1, forged, True))
        resp = c.response(1)
    assert resp.status == 200, resp
    doc = json.loads(bytes(resp.body))
    assert doc["trailers"] == [["x-checksum", "abc"]], doc["trailers"]


def test_request_trailers_h2_client_to_h1_upstream_chunked_are_dropped(
        proxy: ProxyProc, upgrader: UpgradeUpstream) -> None:
    """A body of unknown length goes to an HTTP/1.1 upstream chunked; the client's trailers
    are dropped, as an HTTP/1.1 client's are (and as nginx and Envoy do): aiohttp, for one,
    reads a trailer section into the next request's header section, on a pooled connection
    another client's."""
    before = len(upgrader.heads)
    with FrameClient(proxy.ports["h2c"]) as c:
        c.handshake()
        c.send(c.request(1, "/upload", "POST", authority="upgrade.test", end_stream=False),
               DataFrame(1, data=b"hello "), DataFrame(1, data=b"world"),
               c.headers(1, [("x-digest", "sha-256=abc"), ("content-length", "11")], True))
        resp = c.response(1)
    assert resp.status == 200 and resp.body == b"plain"
    raw = upgrader.heads[before]
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    assert body == b"6\r\nhello \r\n5\r\nworld\r\n0\r\n\r\n"


def test_request_without_trailers_h1_upstream_chunked_ends_plainly(
        proxy: ProxyProc, upgrader: UpgradeUpstream) -> None:
    before = len(upgrader.heads)
    with FrameClient(proxy.ports["h2c"]) as c:
        c.handshake()
        data = DataFrame(1, data=b"abc")
        data.flags.add("END_STREAM")
        c.send(c.request(1, "/upload", "POST", authority="upgrade.test", end_stream=False),
               data)
        assert c.response(1).status == 200
    assert upgrader.heads[before].endswith(b"\r\n\r\n3\r\nabc\r\n0\r\n\r\n")


def test_grpc_timeout_forwarded_is_the_time_left(proxy: ProxyProc,
                                                 latestart: H2Upstream) -> None:
    """The upstream connection is ready only after 600 ms (late SETTINGS): the request
    that waited for it carries what is left of the client's 5 s, in milliseconds. (The
    only request to that upstream: a second one would find the connection open.)"""
    with FrameClient(proxy.ports["h2c"]) as c:
        c.handshake()
        c.send(c.request(1, "/echo", "POST", authority="latestart.test", extra=[
            ("content-type", "application/grpc"), ("te", "trailers"),
            ("grpc-timeout", "5S")]))
        resp = c.response(1)
    assert resp.status == 200
    fields = dict(json.loads(resp.body)["headers"])
    value = fields["grpc-timeout"]
    assert value.endswith("m"), value
    assert 3000 < int(value[:-1]) <= 4450, value


EARLY_KEY = "early-key-0123456789"


@pytest.mark.parametrize("mode", ["h2c", "tls"])
def test_curl_upload_refused_early_exits_cleanly(start_proxy: Any, demo_upstream: int,
                                                pki: Pki, tmp_path: Path, mode: str) -> None:
    """A local reply (401, 413) sent before the client has finished its upload: curl
    (7.x with nghttp2 fails with exit 92 when RST_STREAM arrives with the response) gets
    the whole response and exits 0, over h2c prior knowledge and TLS+ALPN; the proxy
    takes in no more than about a stream window of the refused body."""
    from aiproxy.governance.auth import hash_key

    listener = ('protocols = ["h2c", "http1"]' if mode == "h2c" else
                f'protocols = ["h2", "http1"]\ntls = {{ cert = "{pki.cert}", '
                f'key = "{pki.key}" }}')
    proxy = start_proxy(f"""
[http]
max_body_bytes = 100000

[auth]
api_keys = [{{ id = "k1", subject = "t", hash = "{hash_key(EARLY_KEY)}" }}]

[[clusters]]
name = "demo"
endpoints = ["127.0.0.1:{demo_upstream}"]

[[routes]]
name = "all"
cluster = "demo"
""", listener_extra=listener)
    base = (f"http://127.0.0.1:{proxy.port}" if mode == "h2c"
            else f"https://localhost:{proxy.port}")
    flags = (["--http2-prior-knowledge"] if mode == "h2c" else
             ["--http2", "--cacert", str(pki.ca), "--resolve",
              f"localhost:{proxy.port}:127.0.0.1"])
    big = tmp_path / "big"
    big.write_bytes(BLOCK * 64)  # 4 MiB

    def curl(*args: str, stdin: bytes | None = None) -> tuple[int, dict]:
        proc = subprocess.run(["curl", "-sS", *flags, "-w", "\n@@%{http_code} %{http_version}",
                               *args], input=stdin, capture_output=True, timeout=30,
                              check=False)
        assert proc.returncode == 0, (proc.returncode, proc.stderr.decode())
        body, _, tail = proc.stdout.rpartition(b"\n@@")
        code, version = tail.decode().split()
        assert version == "2", tail
        return int(code), json.loads(body)

    for _ in range(3):
        # (A declared length over the limit is refused first, so no length here.)
        code, doc = curl("-T", "-", f"{base}/echo", stdin=BLOCK * 64)
        assert code == 401 and doc["error"]["code"] == "unauthorized", doc
        code, doc = curl("-H", f"x-api-key: {EARLY_KEY}", "--data-binary", f"@{big}",
                         f"{base}/echo")
        assert code == 413 and doc["error"]["code"] == "payload_too_large", doc
        # No content-length: refused once max_body_bytes have come, in mid-upload.
        code, doc = curl("-H", f"x-api-key: {EARLY_KEY}", "-T", "-", f"{base}/echo",
                         stdin=BLOCK * 64)
        assert code == 413 and doc["error"]["code"] == "payload_too_large", doc
    code, doc = curl("-H", f"x-api-key: {EARLY_KEY}", "--data-binary", "small", f"{base}/echo")
    assert code == 200 and doc["body_bytes"] == 5
    for line in proxy.log().splitlines():
        if line.startswith("{") and '"status":413' in line:
            assert json.loads(line)["bytes_in"] <= 100000 + 2 * 256 * 1024, line


# -- Via (RFC 9110 7.6.3) -----------------------------------------------------------------------

VIA_CONFIG = """
[[listeners]]
name = "mixed"
address = "127.0.0.1:{port}"
protocols = ["http1", "h2c"]

[http]
via = {via}

[[clusters]]
name = "h1"
endpoints = ["127.0.0.1:{h1}"]

[[clusters]]
name = "h10"
endpoints = ["127.0.0.1:{h10}"]

[[clusters]]
name = "h2"
endpoints = ["127.0.0.1:{h2}"]
protocol = "h2"

[[routes]]
name = "h10"
match = { path_prefix = "/h10/" }
cluster = "h10"

[[routes]]
name = "h2"
match = { path_prefix = "/h2/" }
cluster = "h2"

[[routes]]
name = "h1"
cluster = "h1"
"""

CURL_VERSION = {"1.0": "--http1.0", "1.1": "--http1.1", "2": "--http2-prior-knowledge"}


async def via_echo(proto: Any, sid: int, path: str, head: dict[bytes, bytes],
                   body: bytes) -> None:
    """The request's Via field lines, as JSON; the response carries a Via of its own."""
    vias = [v.decode() for k, v in proto.heads[sid] if k == b"via"]
    doc = json.dumps({"headers": {"via": ", ".join(vias)}}).encode()
    proto.conn.send_headers(sid, [(b":status", b"200"), (b"via", b"1.1 origin"),
                                  (b"content-length", str(len(doc)).encode())])
    await proto.send_data(sid, doc, end=True)


class Http10Upstream(socketserver.ThreadingTCPServer):
    """Answers every request with an HTTP/1.0 response echoing the request's Via."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                head = b""
                while b"\r\n\r\n" not in head:
                    data = self.request.recv(65536)
                    if not data:
                        return
                    head += data
                vias = [line.split(b":", 1)[1].strip().decode()
                        for line in head.split(b"\r\n")[1:] if line.lower().startswith(b"via:")]
                doc = json.dumps({"headers": {"via": ", ".join(vias)}}).encode()
                self.request.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                                     % (len(doc), doc))

        super().__init__(("127.0.0.1", 0), Handler)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def via_upstreams(demo_upstream: int) -> Iterator[dict[str, int]]:
    h2 = H2Upstream(via_echo, name="via-h2")
    h10 = Http10Upstream()
    yield {"h1": demo_upstream, "h2": h2.port, "h10": h10.port}
    h2.stop()
    h10.shutdown()
    h10.server_close()


def via_proxy(tmp_path: Path, upstreams: dict[str, int], via: bool) -> ProxyProc:
    text = VIA_CONFIG.replace("{via}", "true" if via else "false")
    for name, port in upstreams.items():
        text = text.replace("{" + name + "}", str(port))
    return ProxyProc(tmp_path, text)


def curl_via(proxy: ProxyProc, version: str, path: str) -> tuple[str | None, str]:
    """(the response's Via, the Via the upstream received) for a request from curl speaking
    `version` that already carries a Via of its own."""
    out = curl("-D", "-", "-o", "-", CURL_VERSION[version], "-H", "Via: 1.1 front",
               f"http://127.0.0.1:{proxy.ports['port']}{path}")
    assert out.returncode == 0, out.stderr
    head, _, body = out.stdout.partition(b"\r\n\r\n")
    vias = [line.split(b":", 1)[1].strip().decode()
            for line in head.split(b"\r\n")[1:] if line.lower().startswith(b"via:")]
    return (", ".join(vias) if vias else None), json.loads(body)["headers"].get("via")


@pytest.mark.parametrize("client", ["1.0", "1.1", "2"])
@pytest.mark.parametrize("upstream,path,response_via", [
    ("h1", "/echo", "1.1 aiproxy"),
    ("h10", "/h10/echo", "1.0 aiproxy"),
    ("h2", "/h2/echo", "1.1 origin, 2 aiproxy"),
])
def test_via_names_the_protocol_received_on_each_hop(
        via_upstreams: dict[str, int], tmp_path: Path, client: str, upstream: str,
        path: str, response_via: str) -> None:
    """RFC 9110 7.6.3: the received-protocol a proxy adds is the version of the message it
    received: the client's request's going upstream, the upstream's response's going to
    the client; appended to the Via the message already had."""
    proxy = via_proxy(tmp_path, via_upstreams, via=True)
    try:
        got_resp, got_req = curl_via(proxy, client, path)
    finally:
        proxy.stop()
    assert got_req == f"1.1 front, {client} aiproxy"
    assert got_resp == response_via


def test_via_off_adds_none(via_upstreams: dict[str, int], tmp_path: Path) -> None:
    proxy = via_proxy(tmp_path, via_upstreams, via=False)
    try:
        for client in CURL_VERSION:
            for path, response_via in (("/echo", None), ("/h10/echo", None),
                                       ("/h2/echo", "1.1 origin")):
                assert curl_via(proxy, client, path) == (response_via, "1.1 front")
    finally:
        proxy.stop()
