"""Differential audit: aiproxy's HTTP/1.1 request framing against h11 (RFC 9112).

Each case is raw client bytes (a few requests at most) tagged with a case id in an
`X-Case` field. The same bytes go to h11 as a server (the reference: which requests the
client sent, with which bodies) and through aiproxy to an asyncio upstream that records
every byte per connection and frames them with h11 again (strictly: what aiproxy sends
must be unambiguous). `check` compares the two.
"""

from __future__ import annotations

import asyncio
import re
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

import h11
import pytest

from tests.conftest import CRASH_MARKERS, simple_config
from tests.support import free_port, start_process, stop_process, wait_port

pytestmark = pytest.mark.timeout(60)

CASE_RE = re.compile(rb"(?im)^x-case:[ \t]*(\d+)")
ALIASED = {b"content-length", b"transfer-encoding", b"x-forwarded-for", b"x-forwarded-proto"}
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@dataclass
class Req:
    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def get(self, name: bytes) -> list[bytes]:
        return [v for n, v in self.headers if n == name]


def h11_requests(data: bytes) -> tuple[list[Req], str | None, bool]:
    """(requests h11 frames in data, its error if any, whether bytes are left over)."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
    conn.receive_data(data)
    out: list[Req] = []
    cur: Req | None = None
    try:
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                return out, None, cur is not None or bool(conn.trailing_data[0])
            if ev is h11.PAUSED or isinstance(ev, h11.ConnectionClosed):
                return out, None, bool(conn.trailing_data[0])
            if isinstance(ev, h11.Request):
                cur = Req(ev.method, ev.target, [(n, v) for n, v in ev.headers], b"")
            elif isinstance(ev, h11.Data):
                cur.body += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                out.append(cur)
                cur = None
                conn.send(h11.Response(status_code=200, headers=[(b"content-length", b"0")]))
                conn.send(h11.EndOfMessage())
                if conn.our_state is h11.MUST_CLOSE:
                    return out, None, bool(conn.trailing_data[0])
                conn.start_next_cycle()
    except h11.ProtocolError as exc:
        return out, f"{type(exc).__name__}: {exc}", True


@dataclass
class UpConn:
    raw: bytearray = field(default_factory=bytearray)
    requests: list[Req] = field(default_factory=list)
    error: str | None = None


class Upstream:
    """Records raw bytes per connection; answers each request h11 frames."""

    def __init__(self) -> None:
        self.conns: list[UpConn] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rec = UpConn()
        self.conns.append(rec)
        conn = h11.Connection(h11.SERVER)
        cur: Req | None = None
        try:
            while True:
                data = await reader.read(65536)
                rec.raw += data
                if rec.error is not None:
                    if not data:
                        break
                    continue
                conn.receive_data(data)
                try:
                    while True:
                        ev = conn.next_event()
                        if ev is h11.NEED_DATA or ev is h11.PAUSED:
                            break
                        if isinstance(ev, h11.ConnectionClosed):
                            break
                        if isinstance(ev, h11.Request):
                            cur = Req(ev.method, ev.target, list(ev.headers), b"")
                        elif isinstance(ev, h11.Data):
                            cur.body += ev.data
                        elif isinstance(ev, h11.EndOfMessage):
                            rec.requests.append(cur)
                            cur = None
                            writer.write(OK)
                            conn.send(h11.Response(status_code=200,
                                                   headers=[(b"content-length", b"2")]))
                            conn.send(h11.Data(data=b"ok"))
                            conn.send(h11.EndOfMessage())
                            if conn.our_state is h11.MUST_CLOSE:
                                break
                            conn.start_next_cycle()
                except h11.ProtocolError as exc:
                    rec.error = f"{type(exc).__name__}: {exc}"
                if not data:
                    break
        finally:
            writer.close()

    def for_case(self, case: int) -> tuple[list[Req], list[UpConn]]:
        """Requests tagged with the case id, and the connections that carried any of its
        bytes (a connection whose first request is the case's, or that names it)."""
        reqs: list[Req] = []
        conns: list[UpConn] = []
        tag = str(case).encode()
        for c in self.conns:
            mine = [r for r in c.requests if r.get(b"x-case") == [tag]]
            if mine or any(m.group(1) == tag for m in CASE_RE.finditer(bytes(c.raw))):
                conns.append(c)
            reqs += mine
        return reqs, conns


@dataclass
class Outcome:
    statuses: list[int]
    eof: bool
    rest: bytes


def parse_responses(data: bytes) -> tuple[list[int], bytes]:
    out = []
    while True:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return out, data
        lines = data[:end].split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        length = 0
        chunked = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
            elif name.lower() == b"transfer-encoding":
                chunked = True
        if chunked:
            return out + [status], b"<chunked>"
        if status == 100:
            out.append(status)
            data = data[end + 4:]
            continue
        if len(data) < end + 4 + length:
            return out, data
        out.append(status)
        data = data[end + 4 + length:]


async def run_client(port: int, pieces: list[bytes], idle: float = 0.5,
                     gap: float = 0.005) -> Outcome:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for i, piece in enumerate(pieces):
        if i:
            await asyncio.sleep(gap)
        writer.write(piece)
        await writer.drain()
    buf = b""
    eof = False
    while True:
        try:
            data = await asyncio.wait_for(reader.read(65536), idle)
        except TimeoutError:
            break
        except ConnectionResetError:
            eof = True
            break
        if not data:
            eof = True
            break
        buf += data
    writer.close()
    statuses, rest = parse_responses(buf)
    return Outcome(statuses, eof, rest)


@dataclass
class Case:
    ident: int
    cls: str
    name: str
    data: bytes
    pieces: list[bytes] | None = None
    # What h11 is given instead of data where h11 is stricter than RFC 9112 allows:
    # the same requests written the way h11 takes them.
    ref: bytes | None = None


def expected_target(method: bytes, target: bytes) -> tuple[bytes, bytes | None]:
    """The origin-form target an upstream should get, and the Host absolute-form sets
    (an OPTIONS with an empty path and no query goes as `*`: RFC 9112 3.2.4)."""
    m = re.match(rb"(?i)https?://([^/?#]*)(.*)", target)
    if not m:
        path, q, query = target.partition(b"?")
        return re.sub(rb"//+", b"/", path) + q + query, None  # merge_slashes (default)
    path = m.group(2) or (b"*" if method == b"OPTIONS" else b"/")
    if path[:1] == b"?":
        path = b"/" + path
    return path, m.group(1)


def check(case: Case, out: Outcome, ups: list[Req], conns: list[UpConn]) -> list[str]:
    """What is wrong with aiproxy's handling of the case (empty: fine)."""
    problems = []
    ref, ref_err, leftover = h11_requests(case.ref or case.data)
    replied = [s for s in out.statuses if s != 100][len(ups):]
    for c in conns:
        if (c.error and "without sending complete message" in c.error
                and (leftover or replied) and not c.requests):
            # A body streams: one the client never finished, or that turned out
            # malformed, is cut off upstream (the connection closed mid-message).
            continue
        if c.error:
            problems.append(f"upstream could not frame what aiproxy sent: {c.error} "
                            f"raw={bytes(c.raw)[:300]!r}")
    for r in ups:
        aliases = [n for n, _ in r.headers if b"_" in n and n.replace(b"_", b"-") in ALIASED]
        if aliases:
            problems.append(f"upstream got {aliases}: read as the fields by CGI-style servers")
        cl, te = r.get(b"content-length"), r.get(b"transfer-encoding")
        if (cl and te) or len(cl) > 1 or len(te) > 1 or (te and te != [b"chunked"]):
            problems.append(f"ambiguous framing upstream: cl={cl} te={te}")
        if len(r.get(b"host")) != 1:
            problems.append(f"upstream Host fields: {r.get(b'host')}")
    n_up = len(ups)
    if n_up > len(ref):
        problems.append(f"aiproxy forwarded {n_up} requests, h11 frames {len(ref)} "
                        f"(h11 error: {ref_err})")
    for i, (got, want) in enumerate(zip(ups, ref, strict=False)):
        tgt, host = expected_target(want.method, want.target)
        if got.method != want.method or got.body != want.body:
            problems.append(f"request {i}: upstream got {got.method!r} body {got.body[:60]!r}, "
                            f"h11 saw {want.method!r} body {want.body[:60]!r}")
        if got.target != tgt:
            problems.append(f"request {i}: upstream target {got.target!r}, expected {tgt!r}")
        if host is not None and got.get(b"host") != [host]:
            problems.append(f"request {i}: upstream Host {got.get(b'host')} for "
                            f"absolute-form authority {host!r}")
    ok = [s for s in out.statuses if s != 100]
    good = ok[:n_up]
    if any(s != 200 for s in good) or len(ok) < n_up:
        problems.append(f"responses {out.statuses} for {n_up} forwarded requests")
    extra = ok[n_up:]
    if len(extra) > 1:
        problems.append(f"more than one local reply: {out.statuses}")
    if extra:
        if extra[0] < 400:
            problems.append(f"unexpected status {extra[0]}")
        elif not out.eof and extra[0] not in (404, 501, 417):
            problems.append(f"no close after local reply {extra[0]}")
    if out.rest:
        problems.append(f"unparsed response bytes {out.rest[:80]!r}")
    return problems


def classify(case: Case, out: Outcome, ups: list[Req]) -> str:
    """A short note on how aiproxy and h11 differ (for the report), '' when alike."""
    ref, ref_err, _ = h11_requests(case.ref or case.data)
    local = [s for s in out.statuses if s != 100][len(ups):]
    if len(ups) == len(ref) and not local and ref_err is None:
        return ""
    if len(ups) < len(ref):
        return f"aiproxy stricter: forwarded {len(ups)}/{len(ref)}, replied {local}"
    if ref_err is not None and not local:
        return f"h11 rejects ({ref_err}), aiproxy replied nothing more"
    if ref_err is None and local:
        return f"aiproxy replied {local} where h11 frames all"
    return ""


async def run_cases(port: int, upstream: Upstream, cases: list[Case],
                    concurrency: int = 64) -> list[tuple[Case, Outcome]]:
    sem = asyncio.Semaphore(concurrency)

    async def one(case: Case) -> tuple[Case, Outcome]:
        async with sem:
            return case, await run_client(port, case.pieces or [case.data])

    results = await asyncio.gather(*(one(c) for c in cases))
    await asyncio.sleep(0.2)  # upstream connections closing behind the last replies
    return list(results)


# -- the corpus: known-good requests mutated at the framing-relevant spots --------------

CRLF = b"\r\n"


def req(line: bytes = b"GET /p HTTP/1.1", headers: list[bytes] | None = None,
        body: bytes = b"", host: bytes | None = b"Host: a", eol: bytes = CRLF) -> bytes:
    hs = [b"X-Case: {id}"]
    if host is not None:
        hs.append(host)
    hs += headers or []
    return line + eol + b"".join(h + eol for h in hs) + eol + body


CL5 = [b"Content-Length: 5"]
TE = [b"Transfer-Encoding: chunked"]
SMUGGLE = b"GET /admin HTTP/1.1\r\nHost: a\r\n\r\n"
CHUNKED = b"5\r\nhello\r\n0\r\n\r\n"


def build() -> list[tuple[str, str, bytes | list[bytes], bytes | None]]:
    """(class, name, bytes, h11's bytes) with `{id}` where the case id goes."""
    out: list[tuple[str, str, bytes | list[bytes], bytes | None]] = []

    def add(cls: str, name: str, data: bytes | list[bytes], ref: bytes | None = None) -> None:
        out.append((cls, name, data, ref))

    # -- request line --------------------------------------------------------------------
    for m in [b"GET", b"get", b"M-SEARCH", b"!#$%&'*+-.^_`|~", b"G@T", b"GE(T", b"G\x7fT",
              b"G\x80T", b"GET\x00", b"", b"\tGET", b" GET"]:
        add("request-line/method", repr(m), req(m + b" /p HTTP/1.1"))
    for line in [b"GET  /p HTTP/1.1", b"GET /p  HTTP/1.1", b"GET\t/p HTTP/1.1",
                 b"GET /p\tHTTP/1.1", b"GET /p HTTP/1.1 ", b"GET /p HTTP/1.1\t",
                 b"GET\x0b/p HTTP/1.1", b"GET\x0c/p HTTP/1.1", b"GET /p\x00 HTTP/1.1",
                 b"GET /p", b"GET /p HTTP/1.1 extra", b"GET /p q HTTP/1.1"]:
        add("request-line/whitespace", repr(line), req(line))
    for v in [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/1.10", b"HTTP/01.1", b"http/1.1", b"HTTP/1.2",
              b"HTTP/1.9", b"HTTP/2.0", b"HTTP/0.9", b"HTTP/1", b"HTTP/1.1x", b"HTTP /1.1",
              b"HTTP/ 1.1", b"HTTP/1 .1", b"HTTP/1.", b"HTTP/1.a", b"HTTPS/1.1", b"HTTP/11",
              b"HTTP/\xb91.1", b"HTTP/3.0"]:
        add("request-line/version", repr(v), req(b"GET /p " + v))
    for t in [b"/p", b"/p?q=1", b"/p?", b"/", b"*", b"http://a/p", b"HTTP://a/p", b"http://a",
              b"http://a?x=1", b"http://a:80/p", b"http://a:/p", b"http://[::1]/p",
              b"https://a/p", b"http://b/p", b"http://u@a/p", b"http://u:p@a/p",
              b"http:///p", b"http://a b/p", b"ftp://a/p", b"a:80", b"a", b"//a/p", b"/p#f",
              b"/p?x#f", b"p", b"/p\x80", b"/p\\q", b"/p%00", b"http://a#f", b"http://a/p#f",
              b"http://a%2f/p", b"http://[::1/p"]:
        add("request-line/target", repr(t), req(b"GET " + t + b" HTTP/1.1"))
    add("request-line/target", "OPTIONS *", req(b"OPTIONS * HTTP/1.1"))
    add("request-line/target", "OPTIONS http://a", req(b"OPTIONS http://a HTTP/1.1"))
    add("request-line/target", "CONNECT a:443", req(b"CONNECT a:443 HTTP/1.1"))
    add("request-line/target", "CONNECT /p", req(b"CONNECT /p HTTP/1.1"))
    add("request-line/target", "absolute-form, Host differs",
        req(b"GET http://b/p HTTP/1.1", host=b"Host: a"))
    add("request-line/target", "absolute-form, no Host",
        req(b"GET http://b/p HTTP/1.1", host=None))
    add("request-line/target", "absolute-form, Host bad",
        req(b"GET http://b/p HTTP/1.1", host=b"Host: a@b"))
    # RFC 9112 2.2: empty lines before a request line are ignored (h11 refuses them).
    for lead in [b"\r\n", b"\r\n\r\n"]:
        add("request-line/leading", repr(lead), lead + req(), req())
    for lead in [b"\n", b"\r", b" ", b"\r\n \r\n", b"\x00"]:
        add("request-line/leading", repr(lead), lead + req())

    # -- header names and lines --------------------------------------------------------
    for h in [b"X-Y: v", b"X_Y: v", b"X Y: v", b"X-Y : v", b"X-Y\t: v", b": v", b"X-Y:v",
              b"X@Y: v", b"X\x80Y: v", b"X\x00Y: v", b"X-Y", b"X-Y;: v", b"\"X\": v",
              b"X-Y: v\r\n c", b"X-Y: v\r\n\tc", b"X-Y:: v", b"X-Y\x7f: v", b"{X}: v",
              b"X_Forwarded_For: 6.6.6.6", b"x-forwarded_proto: https"]:
        add("header/name-line", repr(h), req(headers=[h]))
    add("header/name-line", "first field line folded",
        b"GET /p HTTP/1.1\r\n Host: a\r\nX-Case: {id}\r\nHost: a\r\n\r\n")
    add("header/name-line", "first field line starts with tab",
        b"GET /p HTTP/1.1\r\n\tX: y\r\nX-Case: {id}\r\nHost: a\r\n\r\n")
    for val in [b"a\x00b", b"a\x01b", b"a\x7fb", b"a\x80\xffb", b"a\rb", b"a\nb",
                b"a\x0bb", b"a\tb", b"  a  ", b"a\t", b"", b"\t", b"a\x1bb"]:
        add("header/value", repr(val), req(headers=[b"X-V: " + val]))

    # -- Content-Length -----------------------------------------------------------------
    # 1*DIGIT (RFC 9110 8.6): h11 caps the length of the value.
    add("content-length", "23 digits", req(b"POST /p HTTP/1.1",
                                           [b"Content-Length: 00000000000000000000005"],
                                           b"hello"), req(b"POST /p HTTP/1.1", CL5, b"hello"))
    for v in [b"5", b"05", b"+5", b"-5", b"5 ", b" 5", b"\t5",
              b"5,5", b"5, 5", b"5 ,5", b"5,6", b",5", b"5,", b"5,,5", b"0x5", b"5.0",
              b"", b"1e1", b"5\x00", b"\"5\"", b"5;", b"\xb5", b"\x0b5",
              b"99999999999999999999"]:
        add("content-length", repr(v), req(b"POST /p HTTP/1.1",
                                           [b"Content-Length: " + v], b"hello"))
    add("content-length", "two fields, same", req(b"POST /p HTTP/1.1", CL5 + CL5, b"hello"))
    add("content-length", "two fields, differ",
        req(b"POST /p HTTP/1.1", CL5 + [b"Content-Length: 6"], b"hello!"))
    add("content-length", "name case", req(b"POST /p HTTP/1.1", [b"content-LENGTH: 5"],
                                           b"hello"))
    add("content-length", "underscore name",
        req(b"POST /p HTTP/1.1", [b"Content_Length: 5"], b"hello"))
    add("content-length", "space before colon",
        req(b"POST /p HTTP/1.1", [b"Content-Length : 5"], b"hello"))
    add("content-length", "on GET", req(b"GET /p HTTP/1.1", CL5, b"hello"))
    add("content-length", "0 on GET", req(b"GET /p HTTP/1.1", [b"Content-Length: 0"]))
    add("content-length", "HTTP/1.0", req(b"POST /p HTTP/1.0", CL5, b"hello"))
    add("content-length", "body longer: pipelined GET behind",
        req(b"POST /p HTTP/1.1", CL5, b"hello") + req())
    add("content-length", "Connection: content-length",
        req(b"POST /p HTTP/1.1", CL5 + [b"Connection: content-length"], b"hello"))

    # -- Transfer-Encoding ----------------------------------------------------------------
    for v in [b"chunked", b"Chunked", b"CHUNKED", b" chunked", b"chunked ", b"\tchunked",
              b"chunked, chunked", b"gzip, chunked",
              b"chunked, gzip", b"identity", b"identity, chunked", b"\"chunked\"",
              b"chunked;q=1", b"x-chunked", b"chunk", b"", b"\x0bchunked", b"chunked\x00",
              b"chunked\x0b", b"ch unked", b"chunked\xa0", b"cHuNkEd",
              b"\xc2\xa0chunked"]:
        add("transfer-encoding", repr(v), req(b"POST /p HTTP/1.1",
                                              [b"Transfer-Encoding: " + v], CHUNKED))
    # RFC 9110 5.6.1: empty list elements are ignored; 5.3: fields of one name combine.
    # h11 takes neither.
    te_ref = req(b"POST /p HTTP/1.1", TE, CHUNKED)
    for v in [b"chunked,", b",chunked", b", chunked ,", b"chunkeD,"]:
        add("transfer-encoding", repr(v), req(b"POST /p HTTP/1.1",
                                              [b"Transfer-Encoding: " + v], CHUNKED), te_ref)
    for hs in [[b"Transfer-Encoding: chunked", b"Transfer-Encoding:"],
               [b"Transfer-Encoding:", b"Transfer-Encoding: chunked"]]:
        add("transfer-encoding", " + ".join(h.decode() for h in hs),
            req(b"POST /p HTTP/1.1", hs, CHUNKED), te_ref)
    for hs in [[b"Transfer-Encoding: gzip", b"Transfer-Encoding: chunked"],
               [b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked"],
               [b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip"],
               TE + CL5, CL5 + TE, TE + [b"Content-Length: 0"],
               [b"Transfer-Encoding : chunked"], [b"Transfer-Encoding\t: chunked"],
               [b"Transfer_Encoding: chunked"], [b"Transfer-Encoding: chunked"] + [b"Connection: transfer-encoding"],
               [b"TE: chunked"], [b"transfer-encoding: chunked"]]:
        add("transfer-encoding", " + ".join(h.decode("latin-1") for h in hs),
            req(b"POST /p HTTP/1.1", hs, CHUNKED))
    add("transfer-encoding", "HTTP/1.0 chunked", req(b"POST /p HTTP/1.0", TE, CHUNKED))
    add("transfer-encoding", "chunked on GET", req(b"GET /p HTTP/1.1", TE, CHUNKED))

    # -- chunk-size lines ----------------------------------------------------------------
    def chunk_line(size_line: bytes, data: bytes = b"hello") -> bytes:
        return req(b"POST /p HTTP/1.1", TE, size_line + b"\r\n" + data + b"\r\n0\r\n\r\n")

    for s in [b"5", b"05", b"000005", b"0000000000000005", b"00000000000000005", b"5 ", b" 5", b"\t5", b"5\t", b"5;", b"5;a",
              b"5;a=b", b"5; a", b"5;a =b", b"5;a= b", b"5;a=\"b\"",
              b"5;a=\"b;c\"", b"5;a=\"b\rc\"", b"5;a=\"b\nc\"", b"5;a=\"b\r\nc\"",
              b"5;a=\"\\\"\"", b"5;a=b;c=d", b"5;a=\"b", b"5;=b", b"5;a=", b"5;a b",
              b"5;a=b c", b"0x5", b"+5", b"-5", b"5 5", b"5\x00", b"5;a\x00",
              b"5;a=\"\x7f\"", b"5;a=\"\x80\"", b"5;a=\xff", b"5\x0b", b"5;\xff", b"5;;a",
              b"5,a"]:
        add("chunk-size", repr(s), chunk_line(s))
    # chunk-size = 1*HEXDIG (RFC 9112 7.1): h11 takes at most 20 digits, zeros or not.
    for s in [b"0" * 24 + b"5", b"0" * 4000 + b"5"]:
        add("chunk-size", f"{len(s)} digits, leading zeros", chunk_line(s), chunk_line(b"5"))
    # chunk-ext = *( BWS ";" BWS ext-name [ BWS "=" BWS ext-val ] ) (RFC 9112 7.1.1):
    # h11 takes no BWS before ';'.
    for s in [b"5 ;a", b"5 ; a = b ", b"5\t;a"]:
        add("chunk-size", repr(s), chunk_line(s), chunk_line(b"5;a"))
    add("chunk-size", "bare LF after size",
        req(b"POST /p HTTP/1.1", TE, b"5\nhello\r\n0\r\n\r\n"))
    add("chunk-size", "CR CR LF after size",
        req(b"POST /p HTTP/1.1", TE, b"5\r\r\nhello\r\n0\r\n\r\n"))
    add("chunk-size", "size A, 10 bytes",
        req(b"POST /p HTTP/1.1", TE, b"A\r\nhellohello\r\n0\r\n\r\n"))
    add("chunk-size", "size a, 10 bytes",
        req(b"POST /p HTTP/1.1", TE, b"a\r\nhellohello\r\n0\r\n\r\n"))
    add("chunk-size", "17 hex digits",
        req(b"POST /p HTTP/1.1", TE, b"fffffffffffffffff\r\nhello\r\n0\r\n\r\n"))
    add("chunk-size", "size overflows 64 bits to 5",
        req(b"POST /p HTTP/1.1", TE, b"10000000000000005\r\nhello\r\n0\r\n\r\n"))

    # -- chunk data ----------------------------------------------------------------------
    for d in [b"hello\r\n", b"hello\n", b"hello", b"hello\r", b"helloXX", b"hello\r\r\n",
              b"hello\n\r", b"hell\r\n"]:
        add("chunk-data", repr(d), req(b"POST /p HTTP/1.1", TE, b"5\r\n" + d + b"0\r\n\r\n"))
    add("chunk-data", "several chunks",
        req(b"POST /p HTTP/1.1", TE, b"2\r\nhe\r\n3\r\nllo\r\n0\r\n\r\n"))
    add("chunk-data", "chunk holding a request",
        req(b"POST /p HTTP/1.1", TE, b"%x\r\n" % len(SMUGGLE) + SMUGGLE + b"\r\n0\r\n\r\n"))

    # -- last chunk and trailers ---------------------------------------------------------
    for last in [b"0\r\n\r\n", b"0\r\nX: y\r\n\r\n", b"0\r\nContent-Length: 5\r\n\r\n",
                 b"0\r\nTransfer-Encoding: chunked\r\n\r\n", b"0\r\n X: y\r\n\r\n",
                 b"0\r\nX:y\n\r\n", b"0\n\n", b"0\r\n\n", b"0\n\r\n", b"0;a=b\r\n\r\n",
                 b"00\r\n\r\n", b"0\r\nX y: z\r\n\r\n", b"0\r\nX: y\r\nZ\r\n\r\n",
                 b"0\r\nX: y\r\n\tz\r\n\r\n", b"0\r\nX : y\r\n\r\n", b"0\r\nX: \x00\r\n\r\n",
                 b"0\r\nX: y\rZ: w\r\n\r\n", b"0\r\n: y\r\n\r\n", b"0\r\nHost: evil\r\n\r\n",
                 b"0\r\n\r", b"0\r\n\rX"]:
        add("trailers", repr(last), req(b"POST /p HTTP/1.1", TE, b"5\r\nhello\r\n" + last))

    # -- line endings ----------------------------------------------------------------------
    add("line-endings", "LF everywhere", req(eol=b"\n"))
    add("line-endings", "bare CR everywhere", req(eol=b"\r"))
    add("line-endings", "LF after request line",
        b"GET /p HTTP/1.1\nX-Case: {id}\r\nHost: a\r\n\r\n")
    add("line-endings", "LF after a field", b"GET /p HTTP/1.1\r\nX-Case: {id}\nHost: a\r\n\r\n")
    add("line-endings", "LF ends the head", b"GET /p HTTP/1.1\r\nX-Case: {id}\r\nHost: a\r\n\n")
    add("line-endings", "CR CR LF", b"GET /p HTTP/1.1\r\r\nX-Case: {id}\r\nHost: a\r\n\r\n")
    add("line-endings", "bare CR in request line",
        b"GET /p\rX HTTP/1.1\r\nX-Case: {id}\r\nHost: a\r\n\r\n")
    add("line-endings", "LF CR", b"GET /p HTTP/1.1\n\rX-Case: {id}\r\nHost: a\r\n\r\n")
    add("line-endings", "bare CR between fields",
        b"GET /p HTTP/1.1\r\nX-Case: {id}\rHost: a\r\nHost: a\r\n\r\n")
    add("line-endings", "POST CL, LF head",
        req(b"POST /p HTTP/1.1", CL5, b"hello", eol=b"\n"))
    add("line-endings", "POST TE, LF head",
        req(b"POST /p HTTP/1.1", TE, CHUNKED, eol=b"\n"))

    # -- Host --------------------------------------------------------------------------
    for h in [None, b"Host: a", b"Host:", b"Host: ", b"Host: a b", b"Host: a@b", b"Host: u:p@a",
              b"Host: a:80", b"Host: a:", b"Host: a:x", b"Host: [::1]", b"Host: [::1",
              b"Host: a/b", b"Host: a\t", b"Host: \xe4", b"Host: a,b", b"Host: a:80:80",
              b"host: a", b"HOST: a", b"Host : a", b"Host: a%20", b"Host: a%zz", b"Host: _a"]:
        add("host", repr(h), req(host=h))
    for h in [None, b"Host: a"]:
        add("host", f"HTTP/1.0 {h!r}", req(b"GET /p HTTP/1.0", host=h))
    add("host", "duplicate same", req(headers=[b"Host: a"]))
    add("host", "duplicate differ", req(headers=[b"Host: b"]))
    add("host", "duplicate, one empty", req(headers=[b"Host:"]))
    add("host", "Host list", req(host=b"Host: a, b"))

    # -- Expect ------------------------------------------------------------------------
    for e in [b"100-continue", b"100-Continue", b"100-continue, foo", b"foo", b"", b" 100-continue "]:
        add("expect", f"CL {e!r}", req(b"POST /p HTTP/1.1", CL5 + [b"Expect: " + e], b"hello"))
    add("expect", "chunked 100-continue",
        req(b"POST /p HTTP/1.1", TE + [b"Expect: 100-continue"], CHUNKED))
    add("expect", "GET 100-continue", req(headers=[b"Expect: 100-continue"]))
    add("expect", "HTTP/1.0 100-continue",
        req(b"POST /p HTTP/1.0", CL5 + [b"Expect: 100-continue"], b"hello"))
    add("expect", "two Expect fields",
        req(b"POST /p HTTP/1.1", CL5 + [b"Expect: 100-continue", b"Expect: 100-continue"],
            b"hello"))

    # -- pipelining ----------------------------------------------------------------------
    get = req()
    post_cl = req(b"POST /p HTTP/1.1", CL5, b"hello")
    post_te = req(b"POST /p HTTP/1.1", TE, CHUNKED)
    bad = b"GET /p HTTP/1.1\r\nX-Case: {id}\r\nHost: a\r\nX Y: z\r\n\r\n"
    for name, data in [("GET GET", get + get), ("CL GET", post_cl + get),
                       ("TE GET", post_te + get), ("GET CL:0 GET", req(headers=[b"Content-Length: 0"]) + get),
                       ("GET bad", get + bad), ("GET GET GET", get * 3), ("TE TE", post_te * 2),
                       ("CL TE CL", post_cl + post_te + post_cl), ("GET bad GET", get + bad + get),
                       ("GET, partial", get + b"GET /p HTTP/1.1\r\nHo"),
                       ("CL body holds a request",
                        req(b"POST /p HTTP/1.1", [b"Content-Length: %d" % len(SMUGGLE)],
                            SMUGGLE)),
                       ("Connection: close then GET", req(headers=[b"Connection: close"]) + get),
                       ("HTTP/1.0 then GET", req(b"GET /p HTTP/1.0") + get),

                       ("TE then bad chunk then GET",
                        req(b"POST /p HTTP/1.1", TE, b"5\r\nhelloXX0\r\n\r\n") + get)]:
        add("pipelining", name, data)
    # h11 ends an HTTP/1.0 connection after one request, keep-alive or not (RFC 9112 9.3
    # and C.2.2 let it go on); and it takes no empty line between requests (2.2).
    add("pipelining", "HTTP/1.0 keep-alive then GET",
        req(b"GET /p HTTP/1.0", [b"Connection: keep-alive"]) + get, get + get)
    add("pipelining", "CRLF between requests", get + b"\r\n" + get, get + get)

    # -- byte-boundary splits ----------------------------------------------------------
    tricky = [("TE ext+trailer", req(b"POST /p HTTP/1.1", TE,
                                     b"5;a=\"b;c\"\r\nhello\r\n0\r\nX: y\r\n\r\n")),
              ("CL + GET", post_cl + get),

              ("TE bad ext", req(b"POST /p HTTP/1.1", TE, b"5;a=\"b\rc\"\r\nhello\r\n0\r\n\r\n"))]
    for name, data in tricky:
        add("split", name, [data])  # expanded in cases(): one case per cut
    add("split", "leading CRLF", [b"\r\n" + get], get)
    return out


def cases() -> list[Case]:
    result: list[Case] = []
    for cls, name, data, ref in build():
        if isinstance(data, list):
            cut = 1
            while True:
                tag = str(len(result)).encode()
                whole = data[0].replace(b"{id}", tag)
                if cut >= len(whole):
                    break
                result.append(Case(len(result), cls, f"{name} @{cut}", whole,
                                   [whole[:cut], whole[cut:]],
                                   ref and ref.replace(b"{id}", tag)))
                cut += 1
        else:
            tag = str(len(result)).encode()
            result.append(Case(len(result), cls, name, data.replace(b"{id}", tag),
                               ref=ref and ref.replace(b"{id}", tag)))
    return result


# -- the test ---------------------------------------------------------------------------

# What a local reply may be, by case class (RFC 9112/9110; 417 RFC 9110 10.1.1).
REPLIES = {"request-line/version": {400, 505}, "request-line/target": {400, 404, 501},
           "transfer-encoding": {400, 501}, "expect": {417}}


async def _run(tmp: Path, selected: list[Case]) -> list[str]:
    up = Upstream()
    up_port = await up.start()
    port = free_port()
    cfg = tmp / "aiproxy.toml"
    cfg.write_text('[server]\nworkers = 1\n[[listeners]]\nname = "t"\n'
                   f'address = "127.0.0.1:{port}"\n'
                   + simple_config(up_port, http="max_body_bytes = 1048576",
                                   cluster_extra="max_requests_per_connection = 1"))
    proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(cfg)])
    failures = []
    try:
        wait_port("127.0.0.1", port, proc=proc)
        for case, out in await run_cases(port, up, selected):
            ups, conns = up.for_case(case.ident)
            problems = check(case, out, ups, conns)
            local = [s for s in out.statuses if s != 100][len(ups):]
            allowed = REPLIES.get(case.cls, {400})
            if local and local[0] not in allowed:
                problems.append(f"local reply {local[0]}, expected one of {sorted(allowed)}")
            failures += [f"[{case.cls}] {case.name}: {p}" for p in problems]
    finally:
        log = stop_process(proc)
    assert not any(m in log for m in CRASH_MARKERS), log
    return failures


def test_request_corpus_against_h11(tmp_path: Path) -> None:
    """Every case: aiproxy refuses it (4xx/5xx, then closes) or the upstream gets exactly
    the requests h11 frames in it, unambiguously framed, one response each."""
    selected = cases()
    assert len(selected) > 600
    failures = asyncio.run(_run(tmp_path, selected))
    assert not failures, "\n".join(failures)


