"""HTTP/1.1 wire hot paths: head parsing, head serialization, chunked decoding.

aiproxy._fast.h1 is measured beside httptools (llhttp) for reference, in two forms:
`httptools-bare` runs llhttp with only a message-complete callback (the floor for any
llhttp-based parser), `httptools-callbacks` adds the Python callbacks a proxy needs to see
the URL and every header (one Python call per header: the cost ARCHITECTURE.md describes).
A httptools parser is kept across iterations as on a keep-alive connection; every sample
message is complete, so each feed parses one whole message.
"""

from __future__ import annotations

import httptools
import pytest
from aiproxy._fast.h1 import ChunkedDecoder, parse_request, parse_response

# Header flags from aiproxy/_fast/h1.pxd (cdef enum, so not importable from Python).
F_HOP = 1
F_CONTENT_LENGTH = 2
F_HOST = 8
F_XFF = 128
F_XFP = 256


def _head(*lines: str) -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


SMALL_HEAD = _head(
    "GET /v1/models HTTP/1.1",
    "Host: api.example.com",
    "User-Agent: curl/8.5.0",
    "Accept: */*",
)

BROWSER_HEAD = _head(
    "GET /v1/chat/completions?stream=true HTTP/1.1",
    "Host: api.example.com",
    "Connection: keep-alive",
    'sec-ch-ua: "Chromium";v="124", "Google Chrome";v="124", "Not-A.Brand";v="99"',
    "sec-ch-ua-mobile: ?0",
    'sec-ch-ua-platform: "Linux"',
    "Upgrade-Insecure-Requests: 1",
    "User-Agent: Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) "
    "Chrome/124.0.0.0 Safari/537.36",
    "Accept: text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,"
    "*/*;q=0.8",
    "Sec-Fetch-Site: same-origin",
    "Sec-Fetch-Mode: navigate",
    "Sec-Fetch-User: ?1",
    "Sec-Fetch-Dest: document",
    "Referer: https://app.example.com/chat/7f3a",
    "Accept-Encoding: gzip, deflate, br, zstd",
    "Accept-Language: en-US,en;q=0.9,de;q=0.8",
    "Cookie: session=9d1c0e6b2f4a4e5c8b7a6d5e4f3a2b1c; theme=dark; _ga=GA1.2.1234567890.1700000000",
    "Cache-Control: max-age=0",
    "DNT: 1",
    "Priority: u=0, i",
    "X-Request-Id: 5b8e2f0c-3d4a-4c1b-9e7f-2a6d8c0b1e3f",
)


def _big_head(size: int) -> bytes:
    """A head of exactly `size` bytes: a bearer token and a cookie carry the bulk. No body,
    so that a reused httptools parser sees one complete message per feed."""
    fixed = [
        "GET /v1/files?purpose=fine-tune&limit=100 HTTP/1.1",
        "Host: api.example.com",
        "User-Agent: openai-python/1.30.1",
        "Accept: application/json",
        "OpenAI-Organization: org-3fa85f6457174562b3fc2c963f66afa6",
        "X-Stainless-Lang: python",
        "Authorization: Bearer sk-" + "a1B2c3D4e5F6g7H8" * 10,
    ]
    base = len(_head(*fixed, "Cookie: "))
    cookie = "; ".join(f"c{i}=" + "x" * 40 for i in range(64))[: size - base]
    head = _head(*fixed, "Cookie: " + cookie)
    assert len(head) == size, len(head)
    return head


HEADS = {
    "small": SMALL_HEAD,        # curl-like, 3 fields
    "browser20": BROWSER_HEAD,  # 20 fields
    "2k": _big_head(2048),      # 7 fields, 2 KiB
}
assert BROWSER_HEAD.count(b"\r\n") - 2 == 20

RESPONSE = _head(
    "HTTP/1.1 200 OK",
    "Server: nginx/1.22.1",
    "Date: Sun, 29 Nov 2026 22:00:00 GMT",
    "Content-Type: application/json",
    "Content-Length: 2",
    "Connection: keep-alive",
    "Cache-Control: no-store",
    "X-Request-Id: 5b8e2f0c-3d4a-4c1b-9e7f-2a6d8c0b1e3f",
    "openai-processing-ms: 312",
    "x-ratelimit-remaining-requests: 4999",
) + b"ok"


class _Bare:
    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = 0

    def on_message_complete(self) -> None:
        self.done += 1


class _Collect:
    """What a Python proxy built on httptools does at the least: keep the URL and fields."""

    __slots__ = ("url", "headers", "done")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.done = 0

    def on_message_begin(self) -> None:
        self.headers = []

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_message_complete(self) -> None:
        self.done += 1


def _httptools_feed(parser_cls: type, proto: object, data: bytes):
    parser = parser_cls(proto)
    parser.feed_data(data)
    parser.feed_data(data)
    assert proto.done == 2  # a reused parser parses each feed as one whole message
    return parser.feed_data


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("parser", ["aiproxy", "httptools-bare", "httptools-callbacks"])
def test_parse_request(benchmark, parser: str, head: str) -> None:
    data = HEADS[head]
    benchmark.group = f"parse request: {head} ({len(data)} B)"
    if parser == "aiproxy":
        buf = bytearray(data)  # the proxy parses its connection's bytearray
        h = parse_request(buf)
        assert h.consumed == len(data) and h.header_count == data.count(b"\r\n") - 2
        benchmark(parse_request, buf, 32768, 8192, 100)
    else:
        proto = _Bare() if parser == "httptools-bare" else _Collect()
        benchmark(_httptools_feed(httptools.HttpRequestParser, proto, data), data)


@pytest.mark.parametrize("parser", ["aiproxy", "httptools-bare", "httptools-callbacks"])
def test_parse_response(benchmark, parser: str) -> None:
    benchmark.group = "parse response: 9 fields + 2 B body"
    if parser == "aiproxy":
        buf = bytearray(RESPONSE)
        h = parse_response(buf)
        assert h.status == 200 and h.content_length == 2 and h.consumed == len(RESPONSE) - 2
        benchmark(parse_response, buf, 32768, 100)
    else:
        proto = _Bare() if parser == "httptools-bare" else _Collect()
        benchmark(_httptools_feed(httptools.HttpResponseParser, proto, RESPONSE), RESPONSE)


def test_serialize_request(benchmark) -> None:
    """The upstream request head as Exchange._upstream_head builds it for the browser head:
    Connection, Host, X-Forwarded-* dropped by mask; Host, X-Forwarded-*, Via added."""
    benchmark.group = "serialize head"
    head = parse_request(bytearray(BROWSER_HEAD))
    start = b"GET /v1/chat/completions?stream=true HTTP/1.1\r\n"
    extra = (b"Host: 127.0.0.1:9001\r\nX-Forwarded-For: 127.0.0.1\r\n"
             b"X-Forwarded-Proto: http\r\nVia: 1.1 aiproxy\r\n")
    mask = F_HOP | F_CONTENT_LENGTH | F_HOST | F_XFF | F_XFP
    out = head.serialize(start, extra, mask)
    assert b"Connection:" not in out and out.count(b"\r\n") == 1 + 18 + 4 + 1
    benchmark(head.serialize, start, extra, mask)


def test_serialize_response(benchmark) -> None:
    """The downstream response head as Exchange builds it: Connection and Content-Length
    dropped by mask; Content-Length and Via added."""
    benchmark.group = "serialize head"
    resp = parse_response(bytearray(RESPONSE))
    start = b"HTTP/1.1 %d %s\r\n" % (resp.status, resp.reason)
    extra = b"Via: 1.1 aiproxy\r\nContent-Length: 2\r\n"
    mask = F_HOP | F_CONTENT_LENGTH
    out = resp.serialize(start, extra, mask)
    assert b"Connection:" not in out and out.count(b"\r\n") == 1 + 7 + 2 + 1
    benchmark(resp.serialize, start, extra, mask)


CHUNK = 4096
CHUNKED_BODY = (b"%x\r\n" % CHUNK + b"x" * CHUNK + b"\r\n") * (65536 // CHUNK) + b"0\r\n\r\n"


def _decode_whole(data: bytes) -> list:
    return ChunkedDecoder(32768).feed(data)


def _decode_reads(reads: list[bytes]) -> list:
    dec = ChunkedDecoder(32768)
    out = []
    for r in reads:
        out += dec.feed(r)
    return out


@pytest.mark.parametrize("reads", ["one-feed", "16KiB-reads"])
def test_chunked_decode_64k(benchmark, reads: str) -> None:
    """64 KiB of payload in 4 KiB chunks, fed at once or as 16 KiB socket reads (chunk
    boundaries then fall inside reads)."""
    benchmark.group = "chunked decode: 64 KiB in 4 KiB chunks"
    benchmark.extra_info["wire_bytes"] = len(CHUNKED_BODY)
    if reads == "one-feed":
        fn, arg = _decode_whole, CHUNKED_BODY
    else:
        arg = [CHUNKED_BODY[i:i + 16384] for i in range(0, len(CHUNKED_BODY), 16384)]
        fn = _decode_reads
    assert sum(map(len, fn(arg))) == 65536
    benchmark(fn, arg)
