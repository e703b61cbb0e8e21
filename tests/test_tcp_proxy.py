"""Raw TCP listeners (`protocols = ["tcp"]`, `cluster = "..."`) through the real proxy.

Upstreams are plain sockets in threads of this process; the proxy is the real process.
The byte-carrying tests (echo, 100 MiB each way, half-closes) run spliced and copied in
tests/kernel/test_tcp_splice.py; here: config errors, endpoint choice, upstream down,
graceful stop.
"""

from __future__ import annotations

import json
import signal
import socket
import textwrap
import threading
import time

import pytest

from tests.support import free_port, wait_port
from tests.test_config import problems


def tcp_config(*ports: int, extra: str = "", connect_timeout_ms: int = 2000,
               listener_extra: str = "") -> tuple[str, str]:
    """(listener_extra, body) for start_proxy: a tcp listener in front of cluster `up`."""
    endpoints = ", ".join(f'"127.0.0.1:{p}"' for p in ports)
    listener = 'protocols = ["tcp"]\ncluster = "up"\n' + listener_extra
    body = f"""
{extra}

[[clusters]]
name = "up"
endpoints = [{endpoints}]
connect_timeout_ms = {connect_timeout_ms}
"""
    return listener, body


def start_tcp_proxy(start_proxy, *ports: int, extra: str = "", connect_timeout_ms: int = 2000,
                    listener_extra: str = ""):
    listener, body = tcp_config(*ports, extra=extra, connect_timeout_ms=connect_timeout_ms,
                                listener_extra=listener_extra)
    return start_proxy(body, listener_extra=listener)


def tunnel_lines(proxy) -> list[dict]:
    """The proxy's access log lines for tcp tunnels (the log goes to stderr)."""
    return [json.loads(line) for line in proxy.log().splitlines()
            if line.startswith("{") and '"protocol":"tcp"' in line]


class ThreadServer:
    """A listening socket on 127.0.0.1 that runs `handler(conn)` per connection in a
    thread (sockets closed afterwards); `count` is how many it accepted."""

    def __init__(self, handler) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.handler = handler
        self.count = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.count += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                self.handler(conn)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


def echo(conn: socket.socket) -> None:
    """Echo until EOF, then half-close back."""
    while data := conn.recv(1 << 16):
        conn.sendall(data)
    conn.shutdown(socket.SHUT_WR)


@pytest.fixture
def echo_server():
    server = ThreadServer(echo)
    yield server
    server.close()


def roundtrip(port: int, payload: bytes, timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while data := s.recv(1 << 16):
            got += data
        return got


# == config ==================================================================================


BASE = """\
[[listeners]]
name = "raw"
address = "127.0.0.1:8080"
protocols = ["tcp"]
cluster = "db"

[[clusters]]
name = "db"
endpoints = ["127.0.0.1:9000"]
"""


def test_tcp_listener_config_loads(tmp_path):
    from aiproxy.config import load_config, summary

    path = tmp_path / "ok.toml"
    path.write_text(BASE)
    config = load_config(path)
    listener = config.listeners[0]
    assert listener.protocols == ("tcp",) and listener.cluster == "db"
    assert "listener raw 127.0.0.1:8080 [tcp] -> db" in summary(config)


def test_tcp_listener_config_errors(tmp_path):
    text = BASE.replace('"db"\n\n', '"nope"\n\n', 1) + textwrap.dedent("""\
        [[listeners]]
        name = "mixed"
        address = "127.0.0.1:8081"
        protocols = ["tcp", "http1"]
        cluster = "db"
        [[listeners]]
        name = "nocluster"
        address = "127.0.0.1:8082"
        protocols = ["tcp"]
        [[listeners]]
        name = "http"
        address = "127.0.0.1:8083"
        cluster = "db"
        [[listeners]]
        name = "tls"
        address = "127.0.0.1:8084"
        protocols = ["tcp"]
        cluster = "secure"
        tls = { cert = "c.pem", key = "k.pem" }
        [[listeners]]
        name = "idle"
        address = "127.0.0.1:8085"
        idle_timeout_ms = 1000
        [[listeners]]
        name = "idle2"
        address = "127.0.0.1:8086"
        protocols = ["tcp"]
        cluster = "db"
        idle_timeout_ms = -1
        [[clusters]]
        name = "secure"
        endpoints = ["127.0.0.1:9001"]
        tls = true
        """)
    (tmp_path / "c.pem").write_text("x")
    (tmp_path / "k.pem").write_text("x")
    assert problems(tmp_path, text) == [
        "5: listeners[0].cluster: unknown cluster 'nope' (defined: db, secure)",
        "13: listeners[1].protocols: 'tcp' cannot be combined with HTTP protocols",
        "15: listeners[2].cluster: missing required key",
        "22: listeners[3].cluster: only a tcp listener takes a cluster (HTTP listeners pick "
        "clusters through [[routes]])",
        "28: listeners[4].tls: a tcp listener forwards raw bytes: tls is not supported on it",
        "32: listeners[5].idle_timeout_ms: only a tcp listener takes idle_timeout_ms (HTTP "
        "connections: [http] keepalive_timeout_ms and the body/request timeouts)",
        "38: listeners[6].idle_timeout_ms: must be >= 0, got -1",
    ]


def test_tcp_listener_to_tls_cluster(tmp_path):
    text = BASE + 'tls = true\n'
    assert problems(tmp_path, text) == [
        "5: listeners[0].cluster: cluster 'db' uses tls; a tcp listener forwards raw bytes "
        "to plain TCP endpoints",
    ]


# == endpoints ===============================================================================


@pytest.mark.timeout(60)
def test_echo_and_second_endpoint_when_first_refuses(start_proxy, echo_server):
    dead = free_port()  # nothing listens there: connection refused
    proxy = start_tcp_proxy(start_proxy, dead, echo_server.port)
    for i in range(6):  # round robin starts on each endpoint in turn
        payload = f"message {i} ".encode() * 1000
        assert roundtrip(proxy.port, payload) == payload
    assert f"connect to 127.0.0.1:{dead} failed" in proxy.log()


@pytest.mark.timeout(60)
def test_upstream_down_closes_client(start_proxy):
    proxy = start_tcp_proxy(start_proxy, free_port(), free_port())
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(b"anyone there?")
        try:
            assert s.recv(100) == b""  # closed, nothing forwarded
        except ConnectionResetError:
            pass
    assert "failed" in proxy.log()


@pytest.mark.timeout(60)
def test_connect_timeout_closes_client(start_proxy):
    # A listener that never accepts, its accept queue full: further SYNs go unanswered.
    blocker = socket.create_server(("127.0.0.1", 0), backlog=0)
    address = blocker.getsockname()
    fillers = []
    for _ in range(3):
        f = socket.socket()
        f.setblocking(False)
        f.connect_ex(address)
        fillers.append(f)
    try:
        proxy = start_tcp_proxy(start_proxy, address[1], connect_timeout_ms=300)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            s.sendall(b"hello")
            assert s.recv(100) == b""
        assert f"connect to 127.0.0.1:{address[1]} timed out" in proxy.log()
    finally:
        for f in fillers:
            f.close()
        blocker.close()


# == graceful stop ===========================================================================


@pytest.mark.timeout(60)
def test_graceful_stop_drains_then_closes_tunnels(start_proxy, echo_server):
    proxy = start_tcp_proxy(start_proxy, echo_server.port,
                            extra="[server]\ndrain_timeout_ms = 2000\n")
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=15) as s:
        s.sendall(b"before stop")
        assert s.recv(100) == b"before stop"
        proxy.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        # The listener is closed, the tunnel still carries bytes.
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=2).close()
        s.sendall(b"while draining")
        assert s.recv(100) == b"while draining"
        # After the drain timeout the tunnel is closed and the proxy exits.
        try:
            assert s.recv(100) == b""
        except ConnectionResetError:
            pass
    assert proxy.proc.wait(15) == 0
    assert "drain timeout: closing 1 connections" in proxy.log()


__all__ = ["ThreadServer", "echo", "roundtrip", "start_tcp_proxy", "tunnel_lines", "wait_port"]
