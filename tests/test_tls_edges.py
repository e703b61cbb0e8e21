"""TLS edge cases with real sockets and real TLS peers: what a TLS listener does with
clients that stall in the handshake or offer no usable ALPN, and how the proxy treats TLS
upstreams that close without close_notify or present a certificate that does not verify."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.h2_support import Pki, ProxyProc, client_tls, make_pki
from tests.support import aiproxy_cli

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not shutil.which("openssl"), reason="needs openssl"),
]

# The first bytes of a TLS ClientHello (record header, handshake header, version), and
# then nothing: a client stuck in the handshake.
PARTIAL_CLIENT_HELLO = bytes.fromhex("16030100c8010000c40303")


def _openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    pki = make_pki(d)
    # Certificates that fail verification, each for its own reason.
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    (d / "wrong.ext").write_text("subjectAltName=DNS:wrong.example\n")
    (d / "expired.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, days in (("wrong", "2"), ("expired", "-1")):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", days,
                 "-extfile", f"{name}.ext", cwd=d)
    _openssl("req", "-x509", *ec, "-keyout", "self.key", "-out", "self.pem", "-days", "2",
             "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1", cwd=d)
    return pki


class TlsUpstream:
    """A TLS HTTP/1.1 server on a thread. Every request gets `200` with a body that ends
    when the connection closes (no Content-Length, not chunked): after the body the
    connection is closed with close_notify for a path that starts with /notify, and
    with a bare TCP close (no close_notify: a truncation, RFC 9112 9.8) otherwise."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.ctx.set_alpn_protocols(["http/1.1"])
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stopped = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(10)
            tls = self.ctx.wrap_socket(conn, server_side=True)
            head = b""
            while b"\r\n\r\n" not in head:
                data = tls.recv(4096)
                if not data:
                    return
                head += data
            path = head.split(b" ")[1]
            tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                        b"Connection: close\r\n\r\n" + b"x" * 5000)
            if path.startswith(b"/notify"):
                tls.unwrap()
            tls.close()  # without unwrap(): no close_notify
        except (OSError, ssl.SSLError):
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        self.stopped = True
        self.sock.close()


CONFIG = """
[server]
workers = 1
drain_timeout_ms = 1000

[http]
header_timeout_ms = 1000

[[listeners]]
name = "tls"
address = "127.0.0.1:{{tls}}"
protocols = ["h2", "http1"]
tls = {{ cert = "{pki.cert}", key = "{pki.key}" }}

[[listeners]]
name = "h2only"
address = "127.0.0.1:{{h2only}}"
protocols = ["h2"]
tls = {{ cert = "{pki.cert}", key = "{pki.key}" }}

[[listeners]]
name = "mtls"
address = "127.0.0.1:{{mtls}}"
protocols = ["h2", "http1"]
tls = {{ cert = "{pki.cert}", key = "{pki.key}", ca = "{pki.ca}" }}

[[listeners]]
name = "plain"
address = "127.0.0.1:{{plain}}"
protocols = ["http1"]

[[clusters]]
name = "until-close"
endpoints = ["127.0.0.1:{good}"]
tls = {{ ca = "{pki.ca}", sni = "localhost" }}

[[clusters]]
name = "wrong-host"
endpoints = ["127.0.0.1:{wrong}"]
tls = {{ ca = "{pki.ca}" }}

[[clusters]]
name = "expired"
endpoints = ["127.0.0.1:{expired}"]
tls = {{ ca = "{pki.ca}" }}

[[clusters]]
name = "self-signed"
endpoints = ["127.0.0.1:{self_signed}"]
tls = {{ ca = "{pki.ca}" }}

[[routes]]
name = "wrong-host"
match = {{ host = "wrong.test" }}
cluster = "wrong-host"

[[routes]]
name = "expired"
match = {{ host = "expired.test" }}
cluster = "expired"

[[routes]]
name = "self-signed"
match = {{ host = "self.test" }}
cluster = "self-signed"

[[routes]]
name = "all"
cluster = "until-close"
"""


@pytest.fixture(scope="module")
def upstreams(pki: Pki) -> Iterator[dict[str, TlsUpstream]]:
    d = pki.ca.parent
    ups = {"good": TlsUpstream(pki.cert, pki.key),
           "wrong": TlsUpstream(d / "wrong.pem", d / "wrong.key"),
           "expired": TlsUpstream(d / "expired.pem", d / "expired.key"),
           "self_signed": TlsUpstream(d / "self.pem", d / "self.key")}
    yield ups
    for up in ups.values():
        up.stop()


@pytest.fixture(scope="module")
def proxy(pki: Pki, upstreams: dict[str, TlsUpstream],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProc]:
    text = CONFIG.format(pki=pki, **{k: u.port for k, u in upstreams.items()})
    p = ProxyProc(tmp_path_factory.mktemp("tls-edges"), text, ("tls", "h2only", "mtls", "plain"))
    yield p
    p.stop()


def tls_conn(port: int, alpn: tuple[str, ...] = ()) -> ssl.SSLSocket:
    ctx = client_tls(None, alpn)
    return ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                           server_hostname="localhost")


def read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    out = b""
    while True:
        data = sock.recv(65536)
        if not data:
            return out
        out += data


# -- listeners --------------------------------------------------------------------------


def test_stalled_handshake_is_cut_at_header_timeout(proxy: ProxyProc) -> None:
    """A client that starts a TLS handshake and stalls is closed once header_timeout_ms
    has passed (as nginx bounds its handshake by client_header_timeout), not held for
    uvloop's fixed 60 s default."""
    with socket.create_connection(("127.0.0.1", proxy.ports["tls"])) as sock:
        sock.sendall(PARTIAL_CLIENT_HELLO)
        started = time.monotonic()
        sock.settimeout(10)
        try:
            assert sock.recv(100) == b""
        except ConnectionResetError:
            pass
        assert time.monotonic() - started < 5
    with socket.create_connection(("127.0.0.1", proxy.ports["tls"])) as sock:
        started = time.monotonic()  # nothing sent at all
        sock.settimeout(10)
        try:
            assert sock.recv(100) == b""
        except ConnectionResetError:
            pass
        assert time.monotonic() - started < 5
    assert "Traceback" not in proxy.log()


@pytest.mark.parametrize("listener", ["tls", "h2only"])
def test_plain_http_to_a_tls_port_gets_400(proxy: ProxyProc, listener: str) -> None:
    """http:// typed for https://: the client gets a 400 in clear text that says so (nginx:
    "The plain HTTP request was sent to HTTPS port"), not an empty reply. A request with
    a body still being sent reads the whole 400 (the rest of the body is discarded, not
    reset)."""
    url = f"http://127.0.0.1:{proxy.ports[listener]}/v1/chat/completions"
    for r in (httpx.get(url, timeout=10), httpx.post(url, content=b"x" * 1_000_000, timeout=10)):
        assert r.status_code == 400
        assert r.headers["connection"] == "close"
        error = r.json()["error"]
        assert error["code"] == "bad_request" and "HTTPS port" in error["message"], error
    with tls_conn(proxy.ports[listener], ("h2", "http/1.1")) as sock:  # TLS as before
        assert sock.selected_alpn_protocol() == "h2"
    assert "Traceback" not in proxy.log()


@pytest.mark.parametrize(("alpn", "version"), [
    (("h2", "http/1.1"), "h2"),
    (("http/1.1",), "http/1.1"),
    ((), None),
    (("spdy/3", "foo"), None),  # no protocol in common: no ALPN, HTTP/1.1 (see the report)
])
def test_alpn_choice(proxy: ProxyProc, alpn: tuple[str, ...], version: str | None) -> None:
    with tls_conn(proxy.ports["tls"], alpn) as sock:
        assert sock.selected_alpn_protocol() == version
        if version != "h2":
            sock.sendall(b"GET /notify HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert read_all(sock, 10).startswith(b"HTTP/1.1 200 ")


def test_h2_only_listener_closes_a_client_without_h2(proxy: ProxyProc) -> None:
    with tls_conn(proxy.ports["h2only"], ("http/1.1",)) as sock:
        assert sock.selected_alpn_protocol() is None
        sock.sendall(b"GET /notify HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_all(sock, 10) == b""


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated:DeprecationWarning")
@pytest.mark.parametrize(("version", "ciphers", "alert"), [
    (ssl.TLSVersion.TLSv1_1, "DEFAULT:@SECLEVEL=0", "TLSV1_ALERT_PROTOCOL_VERSION"),
    (ssl.TLSVersion.TLSv1_2, "ECDHE-ECDSA-AES128-SHA:AES128-GCM-SHA256",
     "SSLV3_ALERT_HANDSHAKE_FAILURE"),  # CBC, RSA key exchange: not offered
])
def test_refused_handshake_gets_its_alert(proxy: ProxyProc, version: ssl.TLSVersion,
                                          ciphers: str, alert: str) -> None:
    """RFC 8446 6.2: a failed handshake is answered with the fatal alert that says why,
    not a bare close that the client can only report as an unexpected EOF."""
    ctx = client_tls(None, ("http/1.1",))
    ctx.minimum_version = ctx.maximum_version = version
    ctx.set_ciphers(ciphers)
    with socket.create_connection(("127.0.0.1", proxy.ports["tls"]), timeout=10) as raw:
        with pytest.raises(ssl.SSLError, match=alert):
            ctx.wrap_socket(raw, server_hostname="localhost")


@pytest.mark.parametrize(("cert", "tls12_alert", "tls13_alert"), [
    (None, "TLS alert, handshake failure", "TLSV13_ALERT_CERTIFICATE_REQUIRED"),
    ("other", "TLS alert, unknown CA", "TLSV1_ALERT_UNKNOWN_CA"),
    ("expired", "TLS alert, certificate expired", "SSLV3_ALERT_CERTIFICATE_EXPIRED"),
])
def test_refused_client_certificate_gets_its_alert(proxy: ProxyProc, pki: Pki, cert: str | None,
                                                   tls12_alert: str, tls13_alert: str) -> None:
    """A listener that requires client certificates refuses a missing, expired or
    unknown-CA one with the TLS alert naming the reason, not a bare close."""
    d = pki.ca.parent
    pair = None if cert is None else (d / f"{cert}.pem", d / f"{cert}.key")
    url = f"https://127.0.0.1:{proxy.ports['mtls']}/notify"
    # TLS 1.2: the proxy refuses before its Finished; curl reads the alert (-v shows it).
    args = [] if pair is None else ["--cert", str(pair[0]), "--key", str(pair[1])]
    out = subprocess.run(["curl", "-sSv", "--tls-max", "1.2", "--cacert", str(pki.ca), *args, url],
                         capture_output=True, text=True, timeout=20)
    assert out.returncode != 0 and tls12_alert in out.stderr, out.stderr
    # TLS 1.3: the client's handshake is done before the proxy checks its certificate;
    # the alert is what the client reads next.
    ctx = client_tls(pki, ("http/1.1",), cert=pair)
    with socket.create_connection(("127.0.0.1", proxy.ports["mtls"]), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as sock:
            with pytest.raises(ssl.SSLError, match=tls13_alert):
                sock.recv(100)
    out = subprocess.run(["curl", "-sS", "--cacert", str(pki.ca), "--cert", str(pki.client_cert),
                          "--key", str(pki.client_key), "-o", "/dev/null", "-w", "%{http_code}",
                          url], capture_output=True, text=True, timeout=20)
    assert out.stdout == "200", out.stderr


@pytest.mark.parametrize("protocols", ['["h2c"]', '["http1", "h2c"]'])
def test_h2c_on_a_tls_listener_is_a_config_error(pki: Pki, tmp_path: Path,
                                                 protocols: str) -> None:
    """A TLS listener offers HTTP/2 through ALPN ('h2') only: with 'h2c' it would pass
    check, start, and close every connection after the handshake."""
    path = tmp_path / "h2c_tls.toml"
    path.write_text(f"""[[listeners]]
name = "public"
address = "127.0.0.1:1"
protocols = {protocols}
tls = {{ cert = "{pki.cert}", key = "{pki.key}" }}
""")
    r = aiproxy_cli("check", "-c", str(path))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"{path}:4: listeners[0].protocols: 'h2c' is cleartext "
                                "HTTP/2: over TLS use 'h2'"), r.stderr


# -- upstreams --------------------------------------------------------------------------


def test_until_close_body_with_close_notify_is_complete(proxy: ProxyProc) -> None:
    for http2 in (False, True):
        with httpx.Client(verify=False, http2=http2, timeout=10) as client:
            r = client.get(f"https://127.0.0.1:{proxy.ports['tls']}/notify")
        assert r.status_code == 200 and r.content == b"x" * 5000


def test_until_close_body_without_close_notify_is_truncated(proxy: ProxyProc) -> None:
    """RFC 9112 9.8: a body that ends with the connection is complete only with TLS's
    close_notify; a bare TCP close may be a truncation (an attacker's or a crashed
    upstream's), so the client must not get it as a complete response."""
    # HTTP/1.1 client: the response has gone out chunked; it ends without its last chunk.
    with tls_conn(proxy.ports["tls"], ("http/1.1",)) as sock:
        sock.sendall(b"GET /raw HTTP/1.1\r\nHost: x\r\n\r\n")
        data = read_all(sock, 5)  # before the fix: the connection stays open, a timeout
    assert data.startswith(b"HTTP/1.1 200 "), data[:200]
    assert not data.endswith(b"0\r\n\r\n"), data[-200:]
    # HTTP/2 client: the stream is reset rather than ended.
    with httpx.Client(verify=False, http2=True, timeout=10) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            client.get(f"https://127.0.0.1:{proxy.ports['tls']}/raw")
    assert "close_notify" in proxy.log()


def test_cut_close_delimited_response_to_a_tls_client_has_no_close_notify(
        proxy: ProxyProc) -> None:
    """An HTTP/1.0 client reads a body of unknown length until the close: when the proxy
    cuts that response (here: its upstream's was truncated), the close must not carry
    close_notify, or the client takes the cut body for a whole one (RFC 9112 9.8)."""
    ctx = client_tls(None, ("http/1.1",))
    for path, clean in (("/notify", True), ("/raw", False)):
        with ctx.wrap_socket(socket.create_connection(("127.0.0.1", proxy.ports["tls"]),
                                                      timeout=10),
                             server_hostname="localhost", suppress_ragged_eofs=False) as sock:
            sock.sendall(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
            try:
                data = read_all(sock, 5)
                closed_cleanly = True  # recv() returned b"": a close_notify
            except ConnectionResetError:
                closed_cleanly = False
            except ssl.SSLError as exc:  # SSLEOFError; a plain SSLError before 3.11.3
                assert isinstance(exc, ssl.SSLEOFError) or "UNEXPECTED_EOF" in str(exc), exc
                closed_cleanly = False
        assert closed_cleanly is clean, path
        if clean:
            assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"x" * 5000)


@pytest.mark.parametrize(("host", "why"), [
    ("wrong.test", "mismatch, certificate is not valid for the upstream name"),
    ("expired.test", "certificate has expired"),
    ("self.test", "self-signed certificate"),
])
def test_upstream_verify_failure_says_why(proxy: ProxyProc, host: str, why: str) -> None:
    r = httpx.get(f"http://127.0.0.1:{proxy.ports['plain']}/", headers={"host": host},
                  timeout=10)
    assert r.status_code == 502
    error = r.json()["error"]
    assert error["code"] == "upstream_connect_failed"
    assert "CERTIFICATE_VERIFY_FAILED" in error["message"] and why in error["message"], error
    # The name the certificate was checked against is the endpoint's (its IP here): the
    # client is not told it; the log is.
    assert "127.0.0.1" not in r.text, error
    if host == "wrong.test":
        assert "certificate is not valid for '127.0.0.1'" in proxy.log()
