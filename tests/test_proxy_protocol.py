"""`proxy_protocol = true` on a listener: each connection opens with a PROXY protocol
header (HAProxy's proxy-protocol.txt, v1 and v2) naming the client, whose address then
stands for the client's in X-Forwarded-For and the access log. Real HAProxy in front
(`send-proxy`, `send-proxy-v2`) with a client bound to 127.0.0.2, and hand-made headers
over raw sockets for what HAProxy never sends (TLVs, LOCAL, malformed)."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import struct
import subprocess
import time

import pytest

from aiproxy.protocols.proxy_protocol import ProxyHeaderError, parse_header
from tests.conftest import simple_config
from tests.h2_support import make_pki
from tests.support import free_port, wait_port

SIG = b"\r\n\r\n\x00\r\nQUIT\n"


def v2(command: int, family: int, addresses: bytes, tlvs: bytes = b"") -> bytes:
    body = addresses + tlvs
    return SIG + bytes([0x20 | command, family]) + struct.pack("!H", len(body)) + body


def inet(src: str, dst: str, sport: int, dport: int) -> bytes:
    return socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!HH", sport, dport)


def inet6(src: str, dst: str, sport: int, dport: int) -> bytes:
    return (socket.inet_pton(socket.AF_INET6, src) + socket.inet_pton(socket.AF_INET6, dst)
            + struct.pack("!HH", sport, dport))


# -- the parser ---------------------------------------------------------------------------


@pytest.mark.parametrize("data, expected", [
    (b"PROXY TCP4 192.0.2.1 198.51.100.2 56324 443\r\nGET", (45, "192.0.2.1")),
    (b"PROXY TCP6 2001:db8::1 ::1 1 65535\r\n", (36, "2001:db8::1")),
    (b"PROXY UNKNOWN\r\n", (15, None)),
    (b"PROXY UNKNOWN ffff:f...f:ffff ffff:f...f:ffff 65535 65535\r\n", (59, None)),
    (v2(1, 0x11, inet("192.0.2.9", "10.0.0.1", 1000, 80)) + b"rest", (28, "192.0.2.9")),
    (v2(1, 0x21, inet6("2001:db8::7", "::1", 1, 2)), (52, "2001:db8::7")),
    # TLVs after the addresses (an AWS NLB's VPC endpoint id, say) are skipped
    (v2(1, 0x11, inet("192.0.2.9", "10.0.0.1", 1, 2), b"\xea\x00\x05\x01vpce"),
     (36, "192.0.2.9")),
    (v2(0, 0x00, b""), (16, None)),                                   # LOCAL
    (v2(0, 0x11, inet("192.0.2.9", "10.0.0.1", 1, 2)), (28, None)),   # LOCAL ignores them
    (v2(1, 0x00, b""), (16, None)),                                   # UNSPEC
    (v2(1, 0x31, bytes(216)), (232, None)),                           # AF_UNIX
])
def test_parse_whole_headers(data, expected):
    assert parse_header(data) == expected


@pytest.mark.parametrize("data, expected", [
    (b"PROXY TCP6 ::ffff:10.66.1.2 ::1 5555 80\r\n", (41, "10.66.1.2")),
    (b"PROXY TCP6 ::FFFF:0a42:0102 ::1 5555 80\r\n", (41, "10.66.1.2")),
    (v2(1, 0x21, inet6("::ffff:10.66.1.2", "::1", 1, 2)), (52, "10.66.1.2")),
    (b"PROXY TCP6 2001:DB8:0::1 ::1 1 2\r\n", (34, "2001:db8::1")),
])
def test_parse_names_one_client_by_one_address(data, expected):
    """An IPv4 client named by its IPv4-mapped IPv6 address (a dual-stack balancer's
    TCP6 header) is named by its IPv4 address, as in a TCP4 header; an IPv6 address in
    its canonical spelling."""
    assert parse_header(data) == expected


def test_an_ipv4_mapped_client_meets_the_ipv4_rules(start_proxy, demo_upstream, tmp_path):
    """`PROXY TCP6 ::ffff:10.66.1.2 ...` slipped past a source_cidrs rule on
    10.66.0.0/16 that `PROXY TCP4 10.66.1.2 ...` met, and its X-Forwarded-For named
    another client than the TCP4 header's."""
    pf = tmp_path / "policy.toml"
    pf.write_text('default = "allow"\n[[rules]]\nid = "no-lab-net"\neffect = "deny"\n'
                  'source_cidrs = ["10.66.0.0/16"]\n')
    proxy = start_proxy(simple_config(demo_upstream) + f'\n[policy]\nfiles = ["{pf}"]\n',
                        listener_extra="proxy_protocol = true")
    for header in (b"PROXY TCP4 10.66.1.2 127.0.0.1 5555 80\r\n",
                   b"PROXY TCP6 ::ffff:10.66.1.2 ::1 5555 80\r\n",
                   v2(1, 0x21, inet6("::ffff:10.66.1.2", "::1", 5555, 80))):
        r = get_after(proxy.port, header)
        assert r.startswith(b"HTTP/1.1 403 "), (header, r[:300])
        assert b"no-lab-net" in r, r
    r = get_after(proxy.port, b"PROXY TCP6 ::ffff:10.67.1.2 ::1 5555 80\r\n")
    assert r.startswith(b"HTTP/1.1 200 ") and echo_xff(r) == "10.67.1.2", r[:300]


@pytest.mark.parametrize("data", [
    b"P", b"PROXY", b"PROXY TCP4 192.0.2.1", SIG[:5], SIG, SIG + b"\x21\x11\x00",
    v2(1, 0x11, inet("192.0.2.9", "10.0.0.1", 1, 2))[:27],
])
def test_parse_waits_for_the_rest(data):
    assert parse_header(data) is None


@pytest.mark.parametrize("data, reason", [
    (b"GET / HTTP/1.1\r\n", "no PROXY protocol header"),
    (b"\x16\x03\x01\x02\x00", "no PROXY protocol header"),        # a TLS ClientHello
    (b"PROXX", "no PROXY protocol header"),
    (b"PROXY TCP4 192.0.2.1 198.51.100.2 56324" + b" " * 80, "longer than 107"),
    (b"PROXY TCP5 192.0.2.1 198.51.100.2 1 2\r\n", "not PROXY TCP4|TCP6|UNKNOWN"),
    (b"PROXY TCP4 192.0.2.1 198.51.100.2 1\r\n", "not PROXY TCP4|TCP6|UNKNOWN"),
    (b"PROXY TCP4  192.0.2.1 198.51.100.2 1 2\r\n", "not PROXY TCP4|TCP6|UNKNOWN"),
    (b"PROXY TCP4 192.0.2.01 198.51.100.2 1 2\r\n", "invalid address"),
    (b"PROXY TCP4 2001:db8::1 198.51.100.2 1 2\r\n", "invalid address"),
    (b"PROXY TCP6 192.0.2.1 ::1 1 2\r\n", "invalid address"),
    (b"PROXY TCP4 192.0.2.1 198.51.100.2 65536 2\r\n", "invalid port"),
    (b"PROXY TCP4 192.0.2.1 198.51.100.2 080 2\r\n", "invalid port"),
    (b"PROXY TCP4 192.0.2.1 198.51.100.2 -1 2\r\n", "invalid port"),
    (SIG + b"\x11\x11\x00\x00", "version 1"),
    (SIG + b"\x22\x11\x00\x0c" + bytes(12), "unknown command"),
    (SIG + b"\x21\x41\x00\x0c" + bytes(12), "unknown address family"),
    (SIG + b"\x21\x11\x00\x04" + bytes(4), "shorter than its addresses"),
    (SIG + b"\x21\x11\xff\xff", "v2 header of 65551 bytes"),
])
def test_parse_refuses(data, reason):
    with pytest.raises(ProxyHeaderError, match=reason):
        parse_header(data)


# -- through a proxy ----------------------------------------------------------------------


def echo_xff(response: bytes) -> str:
    body = response.split(b"\r\n\r\n", 1)[1]
    return json.loads(body)["headers"].get("x-forwarded-for")


def get_after(port: int, header: bytes, source: str = "127.0.0.1",
              request: bytes = b"GET /echo HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
              ) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10,
                                  source_address=(source, 0)) as s:
        s.sendall(header + request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def closed_without_reply(port: int, data: bytes) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        try:
            return s.recv(65536) == b""
        except ConnectionResetError:
            return True


@pytest.fixture
def pp_proxy(start_proxy, demo_upstream):
    return start_proxy(simple_config(demo_upstream, http="header_timeout_ms = 1500"),
                       listener_extra='protocols = ["http1", "h2c"]\nproxy_protocol = true')


def test_header_names_the_client(pp_proxy):
    port = pp_proxy.port
    r = get_after(port, b"PROXY TCP4 203.0.113.7 127.0.0.1 40000 80\r\n")
    assert r.startswith(b"HTTP/1.1 200") and echo_xff(r) == "203.0.113.7"
    r = get_after(port, v2(1, 0x21, inet6("2001:db8::5", "::1", 1, 80), b"\x04\x00\x01x"))
    assert echo_xff(r) == "2001:db8::5"
    # LOCAL and UNKNOWN keep the connection's own address
    assert echo_xff(get_after(port, v2(0, 0x00, b""))) == "127.0.0.1"
    assert echo_xff(get_after(port, b"PROXY UNKNOWN\r\n")) == "127.0.0.1"
    # the header and the request in separate, small writes
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for piece in (b"PROXY TCP4 198.51.", b"100.9 127.0.0.1 1 80\r", b"\nGET /echo HTTP/1.1",
                      b"\r\nHost: t\r\nConnection: close\r\n\r\n"):
            s.sendall(piece)
            time.sleep(0.05)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    assert echo_xff(out) == "198.51.100.9"


def test_h2c_after_the_header(pp_proxy):
    import h2.connection
    import h2.events

    with socket.create_connection(("127.0.0.1", pp_proxy.port), timeout=10) as s:
        s.sendall(b"PROXY TCP4 192.0.2.44 127.0.0.1 1 80\r\n")
        conn = h2.connection.H2Connection()
        conn.initiate_connection()
        conn.send_headers(1, [(":method", "GET"), (":path", "/echo"), (":scheme", "http"),
                              (":authority", "t")], end_stream=True)
        s.sendall(conn.data_to_send())
        body, done = b"", False
        while not done:
            data = s.recv(65536)
            assert data
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.DataReceived):
                    body += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, 1)
                done = done or isinstance(ev, h2.events.StreamEnded)
            s.sendall(conn.data_to_send())
    assert json.loads(body)["headers"]["x-forwarded-for"] == "192.0.2.44"


def test_no_or_bad_header_is_closed_without_a_reply(pp_proxy):
    port = pp_proxy.port
    assert closed_without_reply(port, b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n")
    assert closed_without_reply(port, b"PROXY TCP4 203.0.113.7 127.0.0.1 99999 80\r\nGET")
    assert closed_without_reply(port, SIG + b"\x23\x11\x00\x00")
    # half a header, then nothing: closed at header_timeout_ms
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"PROXY TCP4 203.0.113.7")
        started = time.monotonic()
        assert s.recv(100) == b""
        assert time.monotonic() - started < 8
    # the proxy carries on
    assert echo_xff(get_after(port, b"PROXY TCP4 203.0.113.8 127.0.0.1 1 80\r\n")) \
        == "203.0.113.8"


def test_access_log_client_is_the_headers(start_proxy, demo_upstream, tmp_path):
    path = tmp_path / "access.log"
    proxy = start_proxy(simple_config(demo_upstream) + f'\n[access_log]\npath = "{path}"\n'
                        'flush_interval_ms = 10\n', listener_extra="proxy_protocol = true")
    get_after(proxy.port, b"PROXY TCP4 203.0.113.70 127.0.0.1 1 80\r\n")
    deadline = time.monotonic() + 10
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    [line] = [json.loads(x) for x in path.read_text().splitlines()]
    assert line["client"] == "203.0.113.70"


def test_tls_listener_reads_the_header_before_the_handshake(start_proxy, demo_upstream,
                                                            tmp_path):
    pki = make_pki(tmp_path / "pki")
    proxy = start_proxy(simple_config(demo_upstream), listener_extra=(
        f'protocols = ["http1"]\nproxy_protocol = true\n'
        f'tls = {{ cert = "{pki.cert}", key = "{pki.key}" }}'))
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as raw:
        raw.sendall(v2(1, 0x11, inet("192.0.2.99", "127.0.0.1", 5, 443)))
        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
            s.sendall(b"GET /echo HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
    assert echo_xff(out) == "192.0.2.99"


@pytest.mark.skipif(not shutil.which("haproxy"), reason="needs haproxy (make test installs it)")
@pytest.mark.parametrize("send", ["send-proxy", "send-proxy-v2"])
def test_behind_real_haproxy(start_proxy, demo_upstream, tmp_path, send):
    """HAProxy in TCP mode, as a load balancer in front of an edge proxy runs: the client
    connects from 127.0.0.2, HAProxy from 127.0.0.1; the upstream sees 127.0.0.2."""
    proxy = start_proxy(simple_config(demo_upstream), listener_extra="proxy_protocol = true")
    front = free_port()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(f"""
global
    nbthread 1
defaults
    mode tcp
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend f
    bind 127.0.0.1:{front}
    default_backend b
backend b
    server aiproxy 127.0.0.1:{proxy.port} {send}
""")
    hap = subprocess.Popen(["haproxy", "-f", str(cfg), "-db"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE)
    try:
        wait_port("127.0.0.1", front)
        for _ in range(3):
            r = get_after(front, b"", source="127.0.0.2")
            assert r.startswith(b"HTTP/1.1 200"), r[:200]
            assert echo_xff(r) == "127.0.0.2"
    finally:
        hap.terminate()
        hap.wait(10)


def test_config_key_is_a_boolean(tmp_path):
    from aiproxy.config import ConfigError, load_config_text

    text = (f'[[listeners]]\nname = "l"\naddress = "127.0.0.1:{free_port()}"\n'
            'proxy_protocol = "yes"\n' + simple_config(1))
    with pytest.raises(ConfigError) as err:
        load_config_text(text, "pp.toml")
    assert "pp.toml:4: listeners[0].proxy_protocol: expected boolean, got string" in str(
        err.value), str(err.value)


def test_tcp_listener_logs_the_headers_client(start_proxy, demo_upstream, tmp_path):
    """A raw TCP listener: the bytes after the header go upstream unchanged, and the
    tunnel's access log line names the header's client."""
    path = tmp_path / "access.log"
    proxy = start_proxy(simple_config(demo_upstream) + f'\n[access_log]\npath = "{path}"\n'
                        'flush_interval_ms = 10\n', listener_extra=(
                            'protocols = ["tcp"]\ncluster = "up"\nproxy_protocol = true'))
    r = get_after(proxy.port, b"PROXY TCP4 203.0.113.71 127.0.0.1 1 80\r\n")
    assert r.startswith(b"HTTP/1.1 200")
    assert echo_xff(r) is None  # bytes, not HTTP: no field is added
    deadline = time.monotonic() + 10
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    [line] = [json.loads(x) for x in path.read_text().splitlines()]
    assert line["client"] == "203.0.113.71" and line["protocol"] == "tcp"
