"""Rare request shapes at the HTTP/1.1 edge, each to its RFC: OPTIONS in absolute-form
(RFC 9112 3.2.4), Max-Forwards on OPTIONS and TRACE (RFC 9110 7.6.2), CONNECT and the
PRI method on an HTTP/1.1 connection, chunk sizes with leading zeros (RFC 9112 7.1).

One proxy (a real process) serves the module, in front of a recording HTTP/1.1
upstream (tests/test_wire_rejects.py's Recorder) and an HTTP/2 one (h2_support's
H2Upstream, which echoes what it got as JSON); clients are raw sockets and the h2
library."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import CRASH_MARKERS
from tests.h2_support import H2LibClient, H2Upstream
from tests.support import free_port, process_log, start_process, stop_process, wait_port
from tests.test_wire_rejects import Recorder, connect, read_responses

pytestmark = pytest.mark.timeout(30)

H = b"Host: example.test\r\n"


@dataclass
class Edge:
    proc: object
    port: int  # HTTP/1.1
    h2c: int  # HTTP/2 with prior knowledge
    rec: Recorder
    h2up: H2Upstream


CONFIG = """
[[listeners]]
name = "h1"
address = "127.0.0.1:{port}"

[[listeners]]
name = "h2c"
address = "127.0.0.1:{h2c}"
protocols = ["h2c"]

[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{up}"]

[[clusters]]
name = "h2up"
endpoints = ["127.0.0.1:{h2up}"]
protocol = "h2"

[[routes]]
name = "h2up"
match = {{ host = "h2.test" }}
cluster = "h2up"

[[routes]]
name = "all"
cluster = "up"
"""


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    rec = Recorder()
    h2up = H2Upstream(name="h2-edge")
    port, h2c = free_port(), free_port()
    path = tmp_path_factory.mktemp("edges") / "aiproxy.toml"
    path.write_text(CONFIG.format(port=port, h2c=h2c, up=rec.port, h2up=h2up.port))
    proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(path)])
    try:
        wait_port("127.0.0.1", port, proc=proc)
        wait_port("127.0.0.1", h2c, proc=proc)
        yield Edge(proc, port, h2c, rec, h2up)
    finally:
        log = stop_process(proc)
        rec.close()
        h2up.stop()
    assert not any(m in log for m in CRASH_MARKERS), log


@pytest.fixture
def e(edge: Edge) -> Iterator[Edge]:
    """The shared proxy with the recorder emptied; afterwards its log shows no crash."""
    edge.rec.reset()
    yield edge
    log = process_log(edge.proc)
    assert edge.proc.poll() is None, f"proxy exited\n{log}"
    assert not any(m in log for m in CRASH_MARKERS), log


def exchange(port: int, request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    with connect(port) as sock:
        sock.sendall(request)
        [resp] = read_responses(sock, 1)
    return resp.status, resp.headers, resp.body


# -- RFC 9112 3.2.4: OPTIONS in absolute-form with an empty path -------------------------


@pytest.mark.parametrize("target,sent", [
    (b"http://example.test:8080", b"*"),
    (b"HTTP://example.test", b"*"),
    (b"http://example.test:8080/", b"/"),
    (b"http://example.test?x=1", b"/?x=1"),
    (b"http://example.test/p", b"/p"),
], ids=["empty-path", "empty-path-upper-scheme", "slash", "query", "path"])
def test_options_absolute_form_target_upstream(e: Edge, target: bytes, sent: bytes) -> None:
    """An empty path with no query goes on as `*` (the server itself), anything else as
    its origin-form; the authority becomes Host either way."""
    status, _, body = exchange(e.port, b"OPTIONS " + target + b" HTTP/1.1\r\n" + H + b"\r\n")
    assert (status, body) == (200, b"ok")
    [req] = e.rec.requests()
    assert (req.method, req.target) == (b"OPTIONS", sent)
    authority = target.split(b"//", 1)[1].split(b"/", 1)[0].split(b"?", 1)[0]
    assert req.header(b"host") == [authority]


def test_get_absolute_form_empty_path_stays_slash(e: Edge) -> None:
    status, _, _ = exchange(e.port, b"GET http://example.test:8080 HTTP/1.1\r\n" + H + b"\r\n")
    assert status == 200
    [req] = e.rec.requests()
    assert req.target == b"/"


def test_options_absolute_form_empty_path_to_h2_upstream(e: Edge) -> None:
    status, _, body = exchange(e.port, b"OPTIONS http://h2.test HTTP/1.1\r\nHost: h2.test\r\n\r\n")
    assert status == 200, body
    doc = json.loads(body)
    assert (doc["method"], doc["path"], doc["authority"]) == ("OPTIONS", "*", "h2.test")


def test_options_asterisk_to_h2_upstream(e: Edge) -> None:
    status, _, body = exchange(e.port, b"OPTIONS * HTTP/1.1\r\nHost: h2.test\r\n\r\n")
    assert status == 200, body
    assert json.loads(body)["path"] == "*"


def _unused() -> tuple[type, Path]:
    return H2LibClient, Path
