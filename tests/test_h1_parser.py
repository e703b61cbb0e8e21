"""Tests for the strict HTTP/1.1 head scanner and chunked decoder (aiproxy._fast.h1).

In the style of h11's tests: every valid message is parsed whole, one byte at a
time (the parser sees the growing prefix and must answer None until the head is
complete, never raising on a valid prefix), and with pipelined bytes or garbage
after it (`consumed` must point exactly at the end of the head). Every invalid
message must be rejected with the status an origin server would send
(RFC 9112 / RFC 9110), whole, byte by byte and with bytes after it.
"""

import pytest
from aiproxy._fast.h1 import ChunkedDecoder, ParseError, parse_request, parse_response

from aiproxy.pipeline.paths import needs_normalizing

# Flag values, mirrored from aiproxy/_fast/h1.pxd.
F_HOP = 1
F_CONTENT_LENGTH = 2
F_TRANSFER_ENCODING = 4
F_HOST = 8
F_UPGRADE = 16
F_CONNECTION = 32
F_EXPECT = 64
F_XFF = 128
F_XFP = 256
F_NAMED_BY_CONNECTION = 512
F_OWN = 1024
NAMED = F_HOP | F_NAMED_BY_CONNECTION  # 513

# Bytes that may follow a complete head on the wire: a pipelined request,
# a body, or garbage the head scanner must not look at.
AFTER = [
    b"GET /next HTTP/1.1\r\nHost: next\r\n\r\n",
    b"hello",
    b"\r\n\r\n",
    b"\n",
    b"\x00\x7f\xff garbage \r\r\n",
    b" obs-fold-looking\r\n",
]


# --------------------------------------------------------------------------
# helpers


def _head_summary(h):
    return {
        "raw": h.raw,
        "consumed": h.consumed,
        "version": h.version,
        "content_length": h.content_length,
        "chunked": h.chunked,
        "keep_alive": h.keep_alive,
        "connection_upgrade": h.connection_upgrade,
        "upgrade": h.upgrade,
        "header_count": h.header_count,
        "headers": h.headers(),
        "flags": h.header_flags(),
    }


def request_summary(h):
    d = _head_summary(h)
    d.update(
        method=h.method,
        target=h.target,
        host=h.host,
        expect_continue=h.expect_continue,
        expect_unknown=h.expect_unknown,
        has_xff=h.has_xff,
    )
    return d


def response_summary(h):
    d = _head_summary(h)
    d.update(status=h.status, reason=h.reason)
    return d


def _check_valid(parse, summary, data, kw):
    whole = parse(data, **kw)
    assert whole is not None, "complete head reported as incomplete"
    assert whole.consumed == len(data)
    expected = summary(whole)

    # The same head through every buffer type the proxy may hand over.
    for buf in (bytearray(data), memoryview(data)):
        assert summary(parse(buf, **kw)) == expected

    # One byte at a time: None on every proper prefix, never an exception.
    for k in range(len(data)):
        try:
            r = parse(data[:k], **kw)
        except ParseError as exc:  # pragma: no cover - failure path
            pytest.fail(f"valid prefix {data[:k]!r} raised {exc.status} {exc.message}")
        assert r is None, f"prefix {data[:k]!r} of length {k} parsed as complete"

    # Pipelined / trailing bytes are not part of the head.
    for extra in AFTER:
        h = parse(data + extra, **kw)
        assert h is not None
        assert h.consumed == len(data)
        assert summary(h) == expected

    # Forwarding everything with the original start line reproduces the head.
    start_line = whole.raw[: whole.raw.index(b"\r\n") + 2]
    assert whole.serialize(start_line, b"", 0) == whole.raw
    # Every field line appears in raw in order, and nothing else but the start line.
    assert whole.header_count == len(whole.headers()) == len(whole.header_flags())
    return whole


def check_valid_request(data, **kw):
    h = _check_valid(parse_request, request_summary, data, kw)
    # Empty lines before the request line are skipped, and not part of raw.
    assert data.endswith(h.raw)
    assert h.raw.startswith(h.method + b" " + h.target + b" HTTP/")
    return h


def check_valid_response(data, **kw):
    h = _check_valid(parse_response, response_summary, data, kw)
    assert h.raw == data
    return h


def _raises(parse, data, kw):
    with pytest.raises(ParseError) as info:
        parse(data, **kw)
    return info.value


def _check_invalid(parse, data, status, kw, complete=True):
    exc = _raises(parse, data, kw)
    assert exc.status == status, exc.message
    assert isinstance(exc.message, str) and exc.message
    assert str(exc) == exc.message
    # Byte by byte: a prefix is either still incomplete or already rejected
    # with the same status, and once rejected every longer prefix is too.
    failed_at = None
    for k in range(1, len(data) + 1):
        try:
            r = parse(data[:k], **kw)
        except ParseError as e:
            assert e.status == status, (data[:k], e.message)
            if failed_at is None:
                failed_at = k
        else:
            assert failed_at is None, f"prefix of length {k} accepted after length {failed_at} failed"
            assert r is None, f"prefix {data[:k]!r} parsed as a complete head"
    assert failed_at is not None
    if complete:
        for extra in AFTER:
            exc = _raises(parse, data + extra, kw)
            assert exc.status == status, exc.message
    return exc


def check_invalid_request(data, status, complete=True, **kw):
    return _check_invalid(parse_request, data, status, kw, complete)


def check_invalid_response(data, complete=True, **kw):
    return _check_invalid(parse_response, data, 502, kw, complete)


def req(*fields, line=b"GET / HTTP/1.1", host=b"example.com"):
    """A request head: line, Host (unless host is None), then fields."""
    lines = [line]
    if host is not None:
        lines.append(b"Host: " + host)
    lines.extend(fields)
    return b"\r\n".join(lines) + b"\r\n\r\n"


def resp(*fields, line=b"HTTP/1.1 200 OK"):
    return b"\r\n".join([line, *fields]) + b"\r\n\r\n"


# --------------------------------------------------------------------------
# valid requests

VALID_REQUESTS = [
    pytest.param(
        b"GET / HTTP/1.1\r\nHost: example.com\r\n\r\n",
        dict(method=b"GET", target=b"/", version=11, host=b"example.com",
             headers=[(b"Host", b"example.com")], flags=[F_HOST],
             keep_alive=True, content_length=-1, chunked=False),
        id="minimal-get",
    ),
    pytest.param(
        req(b"Content-Length: 5", b"Content-Type: text/plain",
            line=b"POST /submit?x=1&y=%20 HTTP/1.1"),
        dict(method=b"POST", target=b"/submit?x=1&y=%20", content_length=5, chunked=False,
             flags=[F_HOST, F_CONTENT_LENGTH, 0]),
        id="post-content-length",
    ),
    pytest.param(
        req(b"X-AIProxy-Identity: admin", b"x_aiproxy_intent: x", b"X-Aiproxy: 1",
            b"x-aiproxy-: 1", b"x-aiproxyz-a: 1"),
        # The proxy's own names, in any case and in their CGI spelling; not names that
        # only start alike.
        dict(flags=[F_HOST, F_OWN, F_OWN, 0, F_OWN, 0]),
        id="proxy-own-fields",
    ),
    pytest.param(
        req(b"Content-Length: 0", line=b"POST / HTTP/1.1"),
        dict(content_length=0),
        id="content-length-zero",
    ),
    pytest.param(  # 1*DIGIT: leading zeros do not count against the 18 digits
        req(b"Content-Length: " + b"0" * 30 + b"7", line=b"POST / HTTP/1.1"),
        dict(content_length=7),
        id="content-length-many-leading-zeros",
    ),
    pytest.param(
        req(b"Content-Length: 999999999999999999", line=b"PUT /big HTTP/1.1"),
        dict(method=b"PUT", content_length=999999999999999999),
        id="content-length-18-digits",
    ),
    pytest.param(
        req(b"Transfer-Encoding: chunked", line=b"POST /up HTTP/1.1"),
        dict(chunked=True, content_length=-1, flags=[F_HOST, F_TRANSFER_ENCODING | F_HOP]),
        id="post-chunked",
    ),
    pytest.param(
        req(b"transfer-encoding: CHUNKED", line=b"POST /up HTTP/1.1"),
        dict(chunked=True),
        id="chunked-case-insensitive",
    ),
    pytest.param(
        req(b"Transfer-Encoding: , chunked ,", line=b"POST /up HTTP/1.1"),
        dict(chunked=True),
        id="chunked-empty-list-elements",
    ),
    pytest.param(req(line=b"PURGE /cache HTTP/1.1"), dict(method=b"PURGE"), id="custom-method"),
    pytest.param(req(line=b"M-SEARCH * HTTP/1.1"), dict(method=b"M-SEARCH", target=b"*"),
                 id="m-search"),
    pytest.param(req(line=b"get / HTTP/1.1"), dict(method=b"get"), id="lowercase-method-token"),
    pytest.param(
        req(line=b"X!#$%&'*+-.^_`|~9 / HTTP/1.1"),
        dict(method=b"X!#$%&'*+-.^_`|~9"),
        id="method-all-tchars",
    ),
    pytest.param(
        req(line=b"GET http://example.com:8080/p/a?q=1#f HTTP/1.1", host=b"example.com:8080"),
        dict(target=b"http://example.com:8080/p/a?q=1#f", host=b"example.com:8080"),
        id="absolute-form",
    ),
    pytest.param(req(line=b"OPTIONS * HTTP/1.1"), dict(method=b"OPTIONS", target=b"*"),
                 id="asterisk-form"),
    pytest.param(
        req(line=b"CONNECT example.com:443 HTTP/1.1", host=b"example.com:443"),
        dict(method=b"CONNECT", target=b"example.com:443", host=b"example.com:443"),
        id="authority-form",
    ),
    pytest.param(
        req(line=b"GET /%7Euser/a;b=c?x=!$&'()*+,;=:@/?~ HTTP/1.1"),
        dict(target=b"/%7Euser/a;b=c?x=!$&'()*+,;=:@/?~"),
        id="target-all-visible-punctuation",
    ),
    pytest.param(
        b"GET / HTTP/1.0\r\n\r\n",
        dict(version=10, host=None, keep_alive=False, headers=[], flags=[], header_count=0),
        id="http10-no-host",
    ),
    pytest.param(
        req(line=b"GET / HTTP/1.0"),
        dict(version=10, host=b"example.com", keep_alive=False),
        id="http10-with-host",
    ),
    pytest.param(
        req(line=b"GET / HTTP/1.9"),
        dict(version=11),
        id="http1-higher-minor-treated-as-1.1",
    ),
    pytest.param(
        b"\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
        dict(raw=b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", host=b"a"),
        id="leading-crlf",
    ),
    pytest.param(
        b"\r\n\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
        dict(raw=b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", method=b"GET"),
        id="leading-crlfs",
    ),
    pytest.param(
        req(b"X-A: \t  spaced \t out\t \t", b"X-B:tight", host=b" \t example.com \t "),
        dict(host=b"example.com",
             headers=[(b"Host", b"example.com"), (b"X-A", b"spaced \t out"), (b"X-B", b"tight")]),
        id="ows-trimmed-inner-kept",
    ),
    pytest.param(
        req(b"X-Empty:", b"X-Blank:  \t ", b"X-After: v"),
        dict(headers=[(b"Host", b"example.com"), (b"X-Empty", b""), (b"X-Blank", b""),
                      (b"X-After", b"v")]),
        id="empty-values",
    ),
    pytest.param(
        req(b"X-Obs: caf\xc3\xa9 \x80\xff\x9f", b"X-Hi: \xff"),
        dict(headers=[(b"Host", b"example.com"), (b"X-Obs", b"caf\xc3\xa9 \x80\xff\x9f"),
                      (b"X-Hi", b"\xff")]),
        id="obs-text-in-values",
    ),
    pytest.param(
        req(b"X-Vis: !\"#$%&'()*+,-./09:;<=>?@AZ[\\]^_`az{|}~"),
        dict(headers=[(b"Host", b"example.com"),
                      (b"X-Vis", b"!\"#$%&'()*+,-./09:;<=>?@AZ[\\]^_`az{|}~")]),
        id="all-vchars-in-value",
    ),
    pytest.param(
        req(b"!#$%&'*+-.^_`|~09azAZ: tchar-name"),
        dict(headers=[(b"Host", b"example.com"), (b"!#$%&'*+-.^_`|~09azAZ", b"tchar-name")]),
        id="all-tchars-in-name",
    ),
    pytest.param(
        req(b"Content-Length: 5", b"content-length: 5", line=b"POST / HTTP/1.1"),
        dict(content_length=5, flags=[F_HOST, F_CONTENT_LENGTH, F_CONTENT_LENGTH]),
        id="duplicate-identical-content-length",
    ),
    pytest.param(
        req(b"Content-Length: 5, 5", line=b"POST / HTTP/1.1"),
        dict(content_length=5),
        id="content-length-list-identical",
    ),
    pytest.param(
        req(b"Content-Length: 7,7 ,\t7", b"Content-Length: 7", line=b"POST / HTTP/1.1"),
        dict(content_length=7),
        id="content-length-list-and-field-identical",
    ),
    pytest.param(
        req(b"Content-Length: 007", line=b"POST / HTTP/1.1"),
        dict(content_length=7),
        id="content-length-leading-zeros",
    ),
    pytest.param(
        req(b"Connection: close"),
        dict(keep_alive=False, flags=[F_HOST, F_CONNECTION | F_HOP]),
        id="http11-connection-close",
    ),
    pytest.param(
        req(b"Connection: Keep-Alive", line=b"GET / HTTP/1.0"),
        dict(version=10, keep_alive=True),
        id="http10-keep-alive",
    ),
    pytest.param(
        req(b"Connection: keep-alive, CLOSE", line=b"GET / HTTP/1.0"),
        dict(version=10, keep_alive=False),
        id="http10-keep-alive-and-close",
    ),
    pytest.param(
        req(b"Connection: keep-alive"),
        dict(keep_alive=True),
        id="http11-keep-alive-token",
    ),
    pytest.param(
        req(b"Connection: foo", b"Connection: close"),
        dict(keep_alive=False, flags=[F_HOST, F_CONNECTION | F_HOP, F_CONNECTION | F_HOP]),
        id="close-in-second-connection-field",
    ),
    pytest.param(
        req(b"Connection: Upgrade", b"Upgrade: websocket"),
        dict(connection_upgrade=True, upgrade=b"websocket",
             flags=[F_HOST, F_CONNECTION | F_HOP, F_UPGRADE | F_HOP | F_NAMED_BY_CONNECTION]),
        id="upgrade-with-connection-upgrade",
    ),
    pytest.param(
        req(b"Upgrade: h2c, websocket/13", b"Connection: keep-alive,upgrade"),
        dict(connection_upgrade=True, upgrade=b"h2c, websocket/13", keep_alive=True),
        id="upgrade-before-connection",
    ),
    pytest.param(
        # RFC 9110 5.3: field lines of one name are one comma-separated list.
        req(b"Upgrade: websocket", b"Connection: upgrade", b"Upgrade: ", b"Upgrade: foo/2"),
        dict(connection_upgrade=True, upgrade=b"websocket, foo/2"),
        id="upgrade-in-several-fields",
    ),
    pytest.param(
        req(b"Upgrade: websocket"),
        dict(connection_upgrade=False, upgrade=None, flags=[F_HOST, F_UPGRADE | F_HOP]),
        id="upgrade-without-connection-upgrade-ignored",
    ),
    pytest.param(
        req(b"Connection: upgrade"),
        dict(connection_upgrade=True, upgrade=None),
        id="connection-upgrade-without-upgrade",
    ),
    pytest.param(
        req(b"Connection: upgrade", b"Upgrade: websocket", line=b"GET / HTTP/1.0"),
        dict(version=10, upgrade=None),
        id="upgrade-ignored-in-http10",
    ),
    pytest.param(
        req(b"Connection: x-secret, Host, content-length, TE",
            b"X-Secret: 1", b"TE: trailers", b"Content-Length: 0",
            line=b"POST / HTTP/1.1"),
        dict(flags=[F_HOST, F_CONNECTION | F_HOP, NAMED, NAMED, F_CONTENT_LENGTH],
             content_length=0, keep_alive=True),
        id="connection-named-fields",
    ),
    pytest.param(
        req(b"x-SECRET: before", b"Connection: X-Secret", b"X-Other: 1", b"x-secret: after"),
        dict(flags=[F_HOST, NAMED, F_CONNECTION | F_HOP, 0, NAMED]),
        id="connection-named-case-insensitive-any-position",
    ),
    pytest.param(
        req(b"Connection: x-forwarded-for", b"X-Forwarded-For: 10.0.0.1"),
        dict(flags=[F_HOST, F_CONNECTION | F_HOP, F_XFF | NAMED], has_xff=False),
        id="connection-named-xff",
    ),
    pytest.param(
        req(b"Connection: x-a", b"X-A-B: 1", b"X-: 2"),
        dict(flags=[F_HOST, F_CONNECTION | F_HOP, 0, 0]),
        id="connection-named-exact-names-only",
    ),
    pytest.param(
        req(b"Connection: , ,", b"Connection:"),
        dict(keep_alive=True, flags=[F_HOST, F_CONNECTION | F_HOP, F_CONNECTION | F_HOP]),
        id="connection-empty-elements",
    ),
    pytest.param(
        req(b"Connection: " + b", ".join(b"x-%d" % i for i in range(32))),
        dict(keep_alive=True),
        id="connection-32-options",
    ),
    pytest.param(
        req(b"Expect: 100-continue", b"Content-Length: 3", line=b"PUT / HTTP/1.1"),
        dict(expect_continue=True, expect_unknown=False,
             flags=[F_HOST, F_EXPECT | F_HOP, F_CONTENT_LENGTH]),
        id="expect-100-continue",
    ),
    pytest.param(
        req(b"Expect:  100-Continue ", line=b"PUT / HTTP/1.1"),
        dict(expect_continue=True, expect_unknown=False),
        id="expect-100-continue-case-insensitive",
    ),
    pytest.param(
        req(b"Expect: 200-ok", line=b"PUT / HTTP/1.1"),
        dict(expect_continue=False, expect_unknown=True),
        id="expect-unknown",
    ),
    pytest.param(
        req(b"Expect: 100-continue-x"),
        dict(expect_continue=False, expect_unknown=True),
        id="expect-unknown-prefix",
    ),
    pytest.param(
        req(),
        dict(expect_continue=False, expect_unknown=False, has_xff=False),
        id="no-expect",
    ),
    pytest.param(
        # RFC 9110 10.1.1 and 5.6.1: a list; empty elements are ignored.
        req(b"Expect: ,100-continue,, 100-continue ,", line=b"PUT / HTTP/1.1"),
        dict(expect_continue=True, expect_unknown=False),
        id="expect-100-continue-list",
    ),
    pytest.param(
        req(b"Expect: 100-continue, x-custom", line=b"PUT / HTTP/1.1"),
        dict(expect_continue=True, expect_unknown=True),
        id="expect-list-with-unknown",
    ),
    pytest.param(
        req(b"Expect:", line=b"PUT / HTTP/1.1"),
        dict(expect_continue=False, expect_unknown=False),
        id="expect-empty-list",
    ),
    pytest.param(
        # RFC 9110 10.1.1: a 100-continue expectation in HTTP/1.0 MUST be ignored.
        req(b"Expect: 100-continue", b"Content-Length: 3", line=b"PUT / HTTP/1.0"),
        dict(version=10, expect_continue=False, expect_unknown=False),
        id="expect-100-continue-ignored-in-http10",
    ),
    pytest.param(
        req(b"Expect: x-custom", line=b"PUT / HTTP/1.0"),
        dict(version=10, expect_continue=False, expect_unknown=True),
        id="expect-unknown-in-http10",
    ),
    pytest.param(
        req(b"X-Forwarded-For: 1.2.3.4", b"x-forwarded-proto: https"),
        dict(has_xff=True, flags=[F_HOST, F_XFF, F_XFP]),
        id="xff-and-xfp",
    ),
    pytest.param(
        req(b"X-Forwarded-Proto: http"),
        dict(has_xff=False, flags=[F_HOST, F_XFP]),
        id="xfp-only",
    ),
    pytest.param(
        req(b"Proxy: http://evil:8080", b"Proxy-Authorization: Basic eA==",
            b"Proxy-Connection: keep-alive", b"proxy-x: 1", b"Proxyish: 1", b"X-Proxy: 1"),
        dict(flags=[F_HOST, F_HOP, F_HOP, F_HOP, F_HOP, 0, 0]),
        id="proxy-headers-hop",
    ),
    pytest.param(
        req(b"Keep-Alive: timeout=5", b"TE: trailers", b"Trailer: X-Sum"),
        dict(flags=[F_HOST, F_HOP, F_HOP, F_HOP]),
        id="other-hop-by-hop",
    ),
    pytest.param(
        req(host=b""),
        dict(host=b"", headers=[(b"Host", b"")]),
        id="empty-host",
    ),
    pytest.param(
        req(host=b"[2001:db8::1]:8080"),
        dict(host=b"[2001:db8::1]:8080"),
        id="ipv6-host",
    ),
    pytest.param(
        req(host=b"xn--caf-dma.example.org.:80"),
        dict(host=b"xn--caf-dma.example.org.:80"),
        id="host-punycode-trailing-dot",
    ),
    pytest.param(
        req(host=b"a-b_c~d!$&'()*+,;=%41"),
        dict(host=b"a-b_c~d!$&'()*+,;=%41"),
        id="host-reg-name-chars",
    ),
    pytest.param(
        b"GET / HTTP/1.1\r\nhOsT: mixed\r\n\r\n",
        dict(host=b"mixed", flags=[F_HOST]),
        id="host-name-case-insensitive",
    ),
]


@pytest.mark.parametrize(("data", "expected"), VALID_REQUESTS)
def test_valid_request(data, expected):
    h = check_valid_request(data)
    got = request_summary(h)
    for key, value in expected.items():
        assert got[key] == value, key


def test_request_defaults():
    h = check_valid_request(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    assert h.raw == b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
    assert h.consumed == 27
    assert h.content_length == -1
    assert not h.chunked
    assert h.keep_alive
    assert not h.connection_upgrade
    assert h.upgrade is None
    assert not h.expect_continue and not h.expect_unknown and not h.has_xff
    assert repr(h) == "<RequestHead b'GET' b'/' HTTP/1.1>"


def test_incomplete_inputs_return_none():
    for data in (b"", b"\r", b"\r\n", b"\r\n\r", b"\r\n\r\n", b"G", b"GET", b"GET /",
                 b"GET / HTTP/1.1", b"GET / HTTP/1.1\r", b"GET / HTTP/1.1\r\n",
                 b"GET / HTTP/1.1\r\nHost: a\r\n", b"GET / HTTP/1.1\r\nHost: a\r\n\r"):
        assert parse_request(data) is None, data
    for data in (b"", b"H", b"HTTP/1.1", b"HTTP/1.1 200", b"HTTP/1.1 200 OK",
                 b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 200 OK\r\n\r"):
        assert parse_response(data) is None, data


def test_get_and_get_all_case_insensitive():
    h = check_valid_request(req(b"Accept: a", b"X-Dup: one", b"accept: b", b"x-dup: two",
                                b"ACCEPT: c", b"X-Forwarded-For: 1.1.1.1"))
    assert h.get(b"accept") == b"a"
    assert h.get(b"ACCEPT") == b"a"
    assert h.get(b"Accept") == b"a"
    assert h.get_all(b"accept") == [b"a", b"b", b"c"]
    assert h.get_all(b"Accept") == [b"a", b"b", b"c"]
    assert h.get_all(b"x-dup") == [b"one", b"two"]
    assert h.get(b"host") == b"example.com"
    assert h.get(b"x-forwarded-for") == b"1.1.1.1"
    assert h.get(b"missing") is None
    assert h.get_all(b"missing") == []
    assert h.get(b"accep") is None
    assert h.get(b"accepts") is None
    assert h.get(b"") is None
    assert h.get_all(b"") == []
    # names are returned as sent, in arrival order
    assert [n for n, _ in h.headers()] == [b"Host", b"Accept", b"X-Dup", b"accept", b"x-dup",
                                          b"ACCEPT", b"X-Forwarded-For"]


def test_get_does_not_fold_non_letters():
    # Only A-Z fold: '^' | 0x20 == '~' and '_' | 0x20 == DEL must not match.
    h = check_valid_request(req(b"a^b: caret", b"a_b: underscore"))
    assert h.get(b"a~b") is None
    assert h.get(b"a^b") == b"caret"
    assert h.get(b"a\x7fb") is None
    assert h.get(b"a_b") == b"underscore"


def test_serialize_drop_by_mask():
    data = req(
        b"Connection: keep-alive, X-Secret",
        b"Keep-Alive: timeout=5",
        b"X-Secret: s",
        b"Content-Length: 2",
        b"X-Forwarded-For: 1.1.1.1",
        b"X-Forwarded-Proto: http",
        b"Accept:   */*  ",
        b"Proxy: evil",
        line=b"POST /p HTTP/1.1",
    )
    h = check_valid_request(data)
    # Keep-Alive is hop-by-hop anyway, and also named by Connection here.
    assert h.header_flags() == [F_HOST, F_CONNECTION | F_HOP, NAMED, NAMED, F_CONTENT_LENGTH,
                                F_XFF, F_XFP, 0, F_HOP]
    out = h.serialize(b"POST /p HTTP/1.1\r\n", b"X-Forwarded-For: 1.1.1.1, 2.2.2.2\r\n",
                      F_HOP | F_XFF | F_XFP)
    # Kept lines are copied byte for byte (OWS included), in order.
    assert out == (b"POST /p HTTP/1.1\r\n"
                   b"Host: example.com\r\n"
                   b"Content-Length: 2\r\n"
                   b"Accept:   */*  \r\n"
                   b"X-Forwarded-For: 1.1.1.1, 2.2.2.2\r\n"
                   b"\r\n")
    # Runs of kept lines are copied as one piece: every mask over these flags keeps
    # exactly the lines whose flags miss it, whatever runs that makes.
    lines = data.split(b"\r\n")[1:-2]
    flags = h.header_flags()
    for mask in range(1024):
        kept = b"".join(line + b"\r\n" for line, f in zip(lines, flags, strict=True)
                        if not f & mask)
        assert h.serialize(b"S\r\n", b"E\r\n", mask) == b"S\r\n" + kept + b"E\r\n\r\n"
        assert h.compose(b"S\r\n", None, (b"E\r\n",), mask, b"B") == (
            b"S\r\n" + kept + b"E\r\n\r\nB")
    # mask 0 keeps everything; a different start line replaces the original
    assert h.serialize(b"POST /p HTTP/1.0\r\n", b"", 0) == (
        b"POST /p HTTP/1.0\r\n" + data[len(b"POST /p HTTP/1.1\r\n"):])
    # dropping by a single flag
    assert h.serialize(b"", b"", F_NAMED_BY_CONNECTION).count(b"X-Secret: s") == 0
    assert h.serialize(b"", b"", F_HOST).startswith(b"Connection:")
    # every flag in the mask: only unflagged fields are left
    assert h.serialize(b"S\r\n", b"E: 1\r\n", 0xFFFF) == b"S\r\nAccept:   */*  \r\nE: 1\r\n\r\n"
    assert h.serialize(b"", b"", 0xFFFF) == b"Accept:   */*  \r\n\r\n"

    # compose(): the same bytes from a status line, or a request line from method and
    # target, and the added lines as pieces; with body bytes behind the head
    for mask in (0, F_HOP | F_XFF | F_XFP, F_NAMED_BY_CONNECTION, F_HOST, 0xFFFF):
        for start, target, line, extra in (
                (b"POST", b"/p?q=1", b"POST /p?q=1 HTTP/1.1\r\n",
                 (b"E: 1\r\n", None, b"F: 2\r\n", None)),
                (b"GET", b"", b"GET  HTTP/1.1\r\n", ()),
                (b"HTTP/1.1 200 OK\r\n", None, b"HTTP/1.1 200 OK\r\n", (b"", None)),
                (b"", None, b"", (None,))):
            # None pieces are empty slots: left out
            want = h.serialize(line, b"".join(p for p in extra if p is not None), mask)
            assert h.compose(start, target, extra, mask) == want
            assert h.compose(start, target, extra, mask, memoryview(b"body")) == want + b"body"
    with pytest.raises(TypeError):
        h.compose(b"S\r\n", None, (b"E: 1\r\n", "not bytes"), 0)
    with pytest.raises(TypeError):
        h.compose(b"S\r\n", None, (bytearray(b"E: 1\r\n"),), 0)
    with pytest.raises(TypeError):
        h.compose(b"S\r\n", None, [b"E: 1\r\n"], 0)  # a tuple of slots, not a list
    with pytest.raises(TypeError):
        h.compose(None, None, (), 0)
    with pytest.raises(TypeError):
        h.compose(b"S\r\n", None, None, 0)  # no tuple at all: an error, not a crash


def test_serialize_without_fields():
    h = check_valid_request(b"GET / HTTP/1.0\r\n\r\n")
    assert h.header_count == 0
    assert h.headers() == [] and h.header_flags() == []
    assert h.get(b"host") is None and h.get_all(b"host") == []
    assert h.serialize(b"GET / HTTP/1.1\r\n", b"Host: x\r\n", 0) == (
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")


def test_serialize_with_leading_crlfs():
    h = check_valid_request(b"\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\nX-A: 1\r\n\r\n")
    assert h.consumed == 4 + len(h.raw)
    assert h.serialize(b"GET / HTTP/1.1\r\n", b"", F_HOST) == b"GET / HTTP/1.1\r\nX-A: 1\r\n\r\n"


def test_head_is_independent_of_input_buffer():
    buf = bytearray(req(b"X-A: 1"))
    h = parse_request(buf)
    buf[:] = b"\x00" * len(buf)
    assert h.get(b"x-a") == b"1"
    assert h.host == b"example.com"
    assert h.serialize(b"GET / HTTP/1.1\r\n", b"", 0) == req(b"X-A: 1")


def test_parse_does_not_leak_state_between_calls():
    # The scanner uses static scratch tables: a later parse must not see them.
    a = parse_request(req(b"Connection: x-a", b"X-A: 1", b"Content-Length: 3",
                          line=b"POST / HTTP/1.1"))
    b = parse_request(req(b"X-A: 1"))
    assert a.header_flags() == [F_HOST, F_CONNECTION | F_HOP, NAMED, F_CONTENT_LENGTH]
    assert b.header_flags() == [F_HOST, 0]
    assert b.content_length == -1 and b.keep_alive
    assert a.header_flags() == [F_HOST, F_CONNECTION | F_HOP, NAMED, F_CONTENT_LENGTH]
    assert a.get(b"x-a") == b"1"


# --------------------------------------------------------------------------
# limits


def test_request_line_limit():
    ok = b"GET /" + b"a" * 50 + b" HTTP/1.1\r\nHost: a\r\n\r\n"
    check_valid_request(ok, max_line=64)
    long_target = b"GET /" + b"a" * 100
    # complete, then still incomplete (no version yet, mid-target)
    check_invalid_request(long_target + b" HTTP/1.1\r\nHost: a\r\n\r\n", 414, max_line=64)
    check_invalid_request(long_target + b" HTTP/1.1\r\n", 414, complete=False, max_line=64)
    check_invalid_request(long_target, 414, complete=False, max_line=64)
    # a method that never ends: longer than any (RFC 9112 3.1), whatever max_line
    check_invalid_request(b"A" * 100, 501, complete=False, max_line=64)
    check_invalid_request(b"A" * 100, 501, complete=False)
    # default limit
    exc = _raises(parse_request, b"GET /" + b"a" * 9000, {})
    assert exc.status == 414
    check_valid_request(b"GET /" + b"a" * 8000 + b" HTTP/1.1\r\nHost: a\r\n\r\n")


def test_request_line_limit_boundary():
    # method SP target of exactly max_line bytes is accepted, one more is not
    line = b"GET /" + b"a" * 59
    assert len(line) == 64
    check_valid_request(line + b" HTTP/1.1\r\nHost: a\r\n\r\n", max_line=64)
    check_invalid_request(line + b"a HTTP/1.1\r\nHost: a\r\n\r\n", 414, max_line=64)


def test_request_line_limit_not_counting_leading_crlfs():
    data = b"\r\n" * 40 + b"GET /" + b"a" * 50 + b" HTTP/1.1\r\nHost: a\r\n\r\n"
    check_valid_request(data, max_line=64)


def test_head_size_limit():
    base = b"GET / HTTP/1.1\r\nHost: a\r\nX-Pad: "
    # exactly max_head bytes is accepted, one more is rejected
    pad = 256 - len(base) - 4
    check_valid_request(base + b"p" * pad + b"\r\n\r\n", max_head=256)
    check_invalid_request(base + b"p" * (pad + 1) + b"\r\n\r\n", 431, max_head=256)
    # rejected while still incomplete: inside a value, a name, between lines
    check_invalid_request(base + b"p" * 400, 431, complete=False, max_head=256)
    check_invalid_request(b"GET / HTTP/1.1\r\nHost: a\r\nX-" + b"n" * 400, 431,
                          complete=False, max_head=256)
    many = b"GET / HTTP/1.1\r\nHost: a\r\n" + b"X-A: 1\r\n" * 60
    check_invalid_request(many, 431, complete=False, max_head=256, max_headers=1000)
    check_invalid_request(many + b"\r\n", 431, max_head=256, max_headers=1000)
    # default limit
    exc = _raises(parse_request, b"GET / HTTP/1.1\r\nX: " + b"v" * 40000, {})
    assert exc.status == 431


def test_response_head_limits_name_the_response():
    """The scanner is shared with requests; a response's errors must not say "request"."""
    exc = check_invalid_response(b"HTTP/1.1 200 OK\r\nX-Pad: " + b"p" * 400 + b"\r\n\r\n",
                                 max_head=256)
    assert exc.message == "response header section too large"
    exc = check_invalid_response(b"HTTP/1.1 200 OK\r\n" + b"X-A: 1\r\n" * 5 + b"\r\n",
                                 max_headers=4)
    assert exc.message == "too many header fields in response"


def test_head_size_limit_not_counting_leading_crlfs():
    head = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
    h = check_valid_request(b"\r\n" * 10 + head, max_head=len(head))
    assert h.consumed == 20 + len(head)


def test_too_many_leading_empty_lines():
    exc = _raises(parse_request, b"\r\n" * 200, {"max_head": 256})
    assert exc.status == 400


def test_header_count_limit():
    five = [b"X-%d: v" % i for i in range(4)]  # + Host = 5 fields
    h = check_valid_request(req(*five), max_headers=5)
    assert h.header_count == 5
    check_invalid_request(req(*five, b"X-Last: v"), 431, max_headers=5)
    check_invalid_request(b"GET / HTTP/1.1\r\n" + b"X: 1\r\n" * 6, 431, complete=False,
                          max_headers=5)
    h = check_valid_request(req(*[b"X-%d: v" % i for i in range(99)]))
    assert h.header_count == 100
    exc = _raises(parse_request, req(*[b"X-%d: v" % i for i in range(100)]), {})
    assert exc.status == 431


def test_connection_option_limit():
    check_invalid_request(req(b"Connection: " + b", ".join(b"x-%d" % i for i in range(33))),
                          400)
    check_invalid_request(req(*[b"Connection: x-%d" % i for i in range(33)]), 400)


# --------------------------------------------------------------------------
# invalid requests

INVALID_REQUESTS = [
    # message framing (RFC 9112 6)
    pytest.param(req(b"Content-Length: 5", b"Transfer-Encoding: chunked",
                     line=b"POST / HTTP/1.1"), 400, id="cl-and-te"),
    pytest.param(req(b"Transfer-Encoding: chunked", b"Content-Length: 5",
                     line=b"POST / HTTP/1.1"), 400, id="te-and-cl"),
    pytest.param(req(b"Content-Length: 0", b"Transfer-Encoding: gzip, chunked",
                     line=b"POST / HTTP/1.1"), 400, id="cl-and-unsupported-te"),
    pytest.param(req(b"Content-Length: 5", b"Content-Length: 6"), 400, id="cl-differing-dup"),
    pytest.param(req(b"Content-Length: 5", b"Content-Length: 5, 6"), 400,
                 id="cl-differing-in-second-list"),
    pytest.param(req(b"Content-Length: 5, 6"), 400, id="cl-list-differing"),
    pytest.param(req(b"Content-Length: +5"), 400, id="cl-plus"),
    pytest.param(req(b"Content-Length: -1"), 400, id="cl-negative"),
    pytest.param(req(b"Content-Length: 0x5"), 400, id="cl-hex"),
    pytest.param(req(b"Content-Length:  5 5"), 400, id="cl-space-separated"),
    pytest.param(req(b"Content-Length: 5 5"), 400, id="cl-two-numbers"),
    pytest.param(req(b"Content-Length: 1" + b"0" * 18), 400, id="cl-19-digits"),
    pytest.param(req(b"Content-Length: 99999999999999999999999"), 400, id="cl-overflow"),
    pytest.param(req(b"Content-Length:"), 400, id="cl-empty"),
    pytest.param(req(b"Content-Length: 5,"), 400, id="cl-trailing-comma"),
    pytest.param(req(b"Content-Length: ,5"), 400, id="cl-leading-comma"),
    pytest.param(req(b"Content-Length: 5.0"), 400, id="cl-decimal"),
    pytest.param(req(b"Content-Length: 5;q=1"), 400, id="cl-param"),
    pytest.param(req(b"Content-Length: five"), 400, id="cl-word"),
    pytest.param(req(b"Content-Length: 1_000"), 400, id="cl-underscore"),
    pytest.param(req(b"Content-Length: \xd9\xa5"), 400, id="cl-non-ascii-digit"),
    pytest.param(req(b"Transfer-Encoding: gzip", line=b"POST / HTTP/1.1"), 400,
                 id="te-not-chunked"),
    pytest.param(req(b"Transfer-Encoding: chunked, gzip", line=b"POST / HTTP/1.1"), 400,
                 id="te-chunked-not-last"),
    pytest.param(req(b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip",
                     line=b"POST / HTTP/1.1"), 400, id="te-chunked-not-last-across-fields"),
    pytest.param(req(b"Transfer-Encoding: identity", line=b"POST / HTTP/1.1"), 400,
                 id="te-identity"),
    pytest.param(req(b"Transfer-Encoding: chunked, chunked", line=b"POST / HTTP/1.1"), 400,
                 id="te-chunked-twice"),
    pytest.param(req(b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked",
                     line=b"POST / HTTP/1.1"), 400, id="te-chunked-twice-across-fields"),
    pytest.param(req(b"Transfer-Encoding: xchunked", line=b"POST / HTTP/1.1"), 400,
                 id="te-xchunked"),
    pytest.param(req(b"Transfer-Encoding: chunked;x=1", line=b"POST / HTTP/1.1"), 400,
                 id="te-chunked-with-param"),
    pytest.param(req(b"Transfer-Encoding: chunked", line=b"POST / HTTP/1.0"), 400,
                 id="te-in-http10"),
    pytest.param(req(b"Transfer-Encoding: gzip, chunked", line=b"POST / HTTP/1.1"), 501,
                 id="te-unsupported-coding"),
    pytest.param(req(b"Transfer-Encoding: gzip", b"Transfer-Encoding: chunked",
                     line=b"POST / HTTP/1.1"), 501, id="te-unsupported-across-fields"),
    pytest.param(req(b"Transfer-Encoding:", line=b"POST / HTTP/1.1"), 400, id="te-empty"),
    pytest.param(req(b"Transfer-Encoding:  , ,", line=b"POST / HTTP/1.1"), 400,
                 id="te-only-empty-elements"),
    # field syntax (RFC 9112 5, RFC 9110 5.5)
    pytest.param(req(b"X-A: b", b" folded"), 400, id="obs-fold-space"),
    pytest.param(req(b"X-A: b", b"\tfolded"), 400, id="obs-fold-tab"),
    pytest.param(b"GET / HTTP/1.1\r\n Host: a\r\n\r\n", 400, id="ws-before-first-field"),
    pytest.param(b"GET / HTTP/1.1\r\n\tHost: a\r\n\r\n", 400, id="tab-before-first-field"),
    pytest.param(b"GET / HTTP/1.1\r\nHost : a\r\n\r\n", 400, id="space-before-colon"),
    pytest.param(b"GET / HTTP/1.1\r\nHost\t: a\r\n\r\n", 400, id="tab-before-colon"),
    pytest.param(req(b"Content-Length : 5"), 400, id="space-before-colon-cl"),
    pytest.param(req(b"Transfer-Encoding : chunked", line=b"POST / HTTP/1.1"), 400,
                 id="space-before-colon-te"),
    pytest.param(req(b"X A: b"), 400, id="space-in-name"),
    pytest.param(req(b": b"), 400, id="empty-name"),
    pytest.param(req(b":"), 400, id="colon-only"),
    pytest.param(req(b"NoColon"), 400, id="no-colon"),
    pytest.param(req(b"No-Colon "), 400, id="no-colon-trailing-space"),
    pytest.param(req(b"X(A): b"), 400, id="name-paren"),
    pytest.param(req(b"X@A: b"), 400, id="name-at"),
    pytest.param(req(b"X/A: b"), 400, id="name-slash"),
    pytest.param(req(b"X\"A: b"), 400, id="name-dquote"),
    pytest.param(req(b"[X]: b"), 400, id="name-brackets"),
    pytest.param(req(b"X{A}: b"), 400, id="name-braces"),
    pytest.param(req(b"X=A: b"), 400, id="name-equals"),
    pytest.param(req(b"X;A: b"), 400, id="name-semicolon"),
    pytest.param(req(b"X,A: b"), 400, id="name-comma"),
    pytest.param(req(b"X\x00A: b"), 400, id="name-nul"),
    pytest.param(req(b"X\x7fA: b"), 400, id="name-del"),
    pytest.param(req(b"X\x80A: b"), 400, id="name-obs-text"),
    pytest.param(req(b"X-\xc3\xa9: b"), 400, id="name-utf8"),
    pytest.param(req(b"X-A: a\x00b"), 400, id="value-nul"),
    pytest.param(req(b"X-A: \x00"), 400, id="value-nul-only"),
    pytest.param(req(b"X-A: a\x01b"), 400, id="value-soh"),
    pytest.param(req(b"X-A: a\x08b"), 400, id="value-bs"),
    pytest.param(req(b"X-A: a\x0bb"), 400, id="value-vt"),
    pytest.param(req(b"X-A: a\x0cb"), 400, id="value-ff"),
    pytest.param(req(b"X-A: a\x1bb"), 400, id="value-esc"),
    pytest.param(req(b"X-A: a\x1fb"), 400, id="value-us"),
    pytest.param(req(b"X-A: a\x7fb"), 400, id="value-del"),
    pytest.param(req(b"X-A: a\rb"), 400, id="value-bare-cr"),
    pytest.param(req(b"X-A: a\r"), 400, id="value-cr-before-crlf"),
    pytest.param(req(b"X-A: a\nb"), 400, id="value-bare-lf"),
    pytest.param(req(host=b"a\x00b"), 400, id="host-nul"),
    # line endings (RFC 9112 2.2: strict CRLF)
    pytest.param(b"GET / HTTP/1.1\nHost: a\r\n\r\n", 400, id="bare-lf-request-line"),
    pytest.param(b"GET / HTTP/1.1\rHost: a\r\n\r\n", 400, id="bare-cr-request-line"),
    pytest.param(b"GET / HTTP/1.1\r\r\nHost: a\r\n\r\n", 400, id="cr-cr-lf-request-line"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: a\n\r\n", 400, id="bare-lf-field-line"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\nX-C: d\r\n\r\n", 400,
                 id="bare-lf-mid-field-line"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: a\r\n\n", 400, id="bare-lf-final-line"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: a\r\n\rX", 400, id="bare-cr-final-line"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: a\r\n\n\r\n", 400, id="bare-lf-then-crlf"),
    pytest.param(b"GET / HTTP/1.1\nHost: a\n\n", 400, id="all-bare-lf"),
    pytest.param(b"GET / HTTP/1.1\r\n\n", 400, id="bare-lf-empty-head"),
    pytest.param(b"\nGET / HTTP/1.1\r\nHost: a\r\n\r\n", 400, id="leading-bare-lf"),
    pytest.param(b"\r\n\nGET / HTTP/1.1\r\nHost: a\r\n\r\n", 400, id="leading-crlf-bare-lf"),
    pytest.param(b"\rGET / HTTP/1.1\r\nHost: a\r\n\r\n", 400, id="leading-bare-cr"),
    pytest.param(b" \r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n", 400, id="leading-space-line"),
    # Host (RFC 9112 3.2)
    pytest.param(b"GET / HTTP/1.1\r\n\r\n", 400, id="missing-host"),
    pytest.param(b"GET / HTTP/1.1\r\nX-Host: a\r\n\r\n", 400, id="missing-host-x-host"),
    pytest.param(req(b"Host: example.com"), 400, id="two-identical-hosts"),
    pytest.param(req(b"host: other"), 400, id="two-hosts"),
    pytest.param(req(b"Host: b", line=b"GET / HTTP/1.0", host=b"a"), 400,
                 id="two-hosts-http10"),
    pytest.param(req(host=b"a b"), 400, id="host-space"),
    pytest.param(req(host=b"a/b"), 400, id="host-slash"),
    pytest.param(req(host=b"user@a"), 400, id="host-userinfo"),
    pytest.param(req(host=b"a?b"), 400, id="host-query"),
    pytest.param(req(host=b"a#b"), 400, id="host-fragment"),
    pytest.param(req(host=b"a\"b"), 400, id="host-dquote"),
    pytest.param(req(host=b"a\\b"), 400, id="host-backslash"),
    pytest.param(req(host=b"a\tb"), 400, id="host-tab"),
    pytest.param(req(host=b"caf\xc3\xa9.example"), 400, id="host-utf8"),
    pytest.param(req(host=b"a<b>"), 400, id="host-angle"),
    pytest.param(b"GET / HTTP/1.0\r\nHost: a b\r\n\r\n", 400, id="bad-host-http10"),
    # request line (RFC 9112 3)
    pytest.param(req(line=b"GET  / HTTP/1.1"), 400, id="two-spaces-after-method"),
    pytest.param(req(line=b"GET /  HTTP/1.1"), 400, id="two-spaces-after-target"),
    pytest.param(req(line=b" GET / HTTP/1.1"), 400, id="leading-space"),
    pytest.param(req(line=b"GET\t/ HTTP/1.1"), 400, id="tab-after-method"),
    pytest.param(req(line=b"GET /\tHTTP/1.1"), 400, id="tab-after-target"),
    pytest.param(req(line=b"GET / HTTP/1.1 "), 400, id="trailing-space"),
    pytest.param(req(line=b"GET / HTTP/1.1\t"), 400, id="trailing-tab"),
    pytest.param(req(line=b"GET /"), 400, id="missing-version"),
    pytest.param(req(line=b"GET / "), 400, id="missing-version-after-space"),
    pytest.param(req(line=b"GET"), 400, id="method-only"),
    pytest.param(req(line=b"GET "), 400, id="missing-target"),
    pytest.param(req(line=b"/ HTTP/1.1"), 400, id="missing-method"),
    pytest.param(req(line=b" / HTTP/1.1"), 400, id="empty-method"),
    pytest.param(req(line=b"GET / HTTP/1.1x"), 400, id="version-suffix"),
    pytest.param(req(line=b"GET / HTTP/1.10"), 400, id="version-minor-two-digits"),
    pytest.param(req(line=b"GET / HTTP/11.1"), 400, id="version-major-two-digits"),
    pytest.param(req(line=b"GET / HTTP/1.1.1"), 400, id="version-three-parts"),
    pytest.param(req(line=b"GET / http/1.1"), 400, id="version-lowercase"),
    pytest.param(req(line=b"GET / Http/1.1"), 400, id="version-mixed-case"),
    pytest.param(req(line=b"GET / HTTP/1"), 400, id="version-no-minor"),
    pytest.param(req(line=b"GET / HTTP/1."), 400, id="version-dot-no-minor"),
    pytest.param(req(line=b"GET / HTTP/2"), 400, id="version-2-no-minor"),
    pytest.param(req(line=b"GET / HTTP/1,1"), 400, id="version-comma"),
    pytest.param(req(line=b"GET / HTTP/a.b"), 400, id="version-letters"),
    pytest.param(req(line=b"GET / HTTP /1.1"), 400, id="version-space"),
    pytest.param(req(line=b"GET / HTTPS/1.1"), 400, id="version-https"),
    pytest.param(req(line=b"GET / FOO/1.1"), 400, id="version-foo"),
    pytest.param(req(line=b"GET / HTTP/1.1 extra"), 400, id="extra-token"),
    pytest.param(req(line=b"GE(T / HTTP/1.1"), 400, id="method-paren"),
    pytest.param(req(line=b"G@T / HTTP/1.1"), 400, id="method-at"),
    pytest.param(req(line=b"GET\x00 / HTTP/1.1"), 400, id="method-nul"),
    pytest.param(req(line=b"G\xc3\x89T / HTTP/1.1"), 400, id="method-non-ascii"),
    pytest.param(req(line=b"GET /\x00 HTTP/1.1"), 400, id="target-nul"),
    pytest.param(req(line=b"GET /\x7f HTTP/1.1"), 400, id="target-del"),
    pytest.param(req(line=b"GET /\x01 HTTP/1.1"), 400, id="target-ctl"),
    pytest.param(req(line=b"GET /caf\xc3\xa9 HTTP/1.1"), 400, id="target-utf8"),
    pytest.param(req(line=b"GET /\x80 HTTP/1.1"), 400, id="target-obs-text"),
    pytest.param(req(line=b"GET /\xff HTTP/1.1"), 400, id="target-0xff"),
    pytest.param(req(line=b"GET / HTTP/1.1\x00"), 400, id="nul-after-version"),
    pytest.param(b"GET /\r\n\r\n", 400, id="http09-simple-request"),
    pytest.param(b"GET /\r\nHost: a\r\n\r\n", 400, id="http09-with-fields"),
    pytest.param(req(line=b"GET / HTTP/2.0"), 505, id="http20"),
    pytest.param(req(line=b"GET / HTTP/3.0"), 505, id="http30"),
    pytest.param(req(line=b"GET / HTTP/9.9"), 505, id="http99"),
    pytest.param(req(line=b"GET / HTTP/0.9"), 505, id="http09-versioned"),
    pytest.param(req(line=b"GET / HTTP/0.0"), 505, id="http00"),
    pytest.param(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505, id="h2-preface"),
]


@pytest.mark.parametrize(("data", "status"), INVALID_REQUESTS)
def test_invalid_request(data, status):
    check_invalid_request(data, status)


@pytest.mark.parametrize("c", [c for c in range(0x20)
                               if c not in (0x09, 0x0A, 0x0D)] + [0x7F])
def test_every_ctl_rejected_in_value(c):
    check_invalid_request(req(b"X-A: a" + bytes([c]) + b"b"), 400)
    check_invalid_request(req(b"X-A: " + bytes([c])), 400)


@pytest.mark.parametrize("c", [0x80, 0x85, 0x9F, 0xA0, 0xC3, 0xE9, 0xFE, 0xFF])
def test_obs_text_accepted_in_value_rejected_elsewhere(c):
    b = bytes([c])
    h = check_valid_request(req(b"X-A: " + b))
    assert h.get(b"x-a") == b
    check_invalid_request(req(b"X-" + b + b": v"), 400)
    check_invalid_request(req(line=b"GET /" + b + b" HTTP/1.1"), 400)
    check_invalid_request(req(line=b"GE" + b + b" / HTTP/1.1"), 400)
    check_invalid_request(req(host=b"a" + b), 400)


@pytest.mark.parametrize("c", range(256))
def test_name_characters(c):
    """Field names are exactly tokens (RFC 9110 5.1)."""
    tchar = (b"!#$%&'*+-.^_`|~0123456789"
             b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    data = req(b"X" + bytes([c]) + b"Y: v")
    if c in tchar:
        h = parse_request(data)
        assert h.headers()[1] == (b"X" + bytes([c]) + b"Y", b"v")
    elif c == ord(":"):  # the first colon ends the name
        assert parse_request(data).headers()[1] == (b"X", b"Y: v")
    else:
        with pytest.raises(ParseError) as info:
            parse_request(data)
        assert info.value.status == 400


@pytest.mark.parametrize("c", range(256))
def test_target_characters(c):
    """The request-target is visible ASCII, not '"', '<', '>' (RFC 3986 has no place for
    them, and browsers and httpx always encode them; RFC 9112 3.2: an invalid request-line is a
    400). '\\', '^', '`', '{', '|', '}' pass: curl, httpx and browsers send them."""
    data = req(line=b"GET /x" + bytes([c]) + b"y HTTP/1.1")
    if 0x21 <= c <= 0x7E and c not in b'"<>':
        assert parse_request(data).target == b"/x" + bytes([c]) + b"y"
    else:
        with pytest.raises(ParseError) as info:
            parse_request(data)
        assert info.value.status == 400


def test_every_method_token():
    for m in (b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"CONNECT", b"OPTIONS", b"TRACE",
              b"PATCH", b"PROPFIND", b"MKCOL", b"BREW", b"A", b"UPDATEREDIRECTREF", b"x" * 32):
        assert parse_request(req(line=m + b" / HTTP/1.1")).method == m


@pytest.mark.parametrize("target", [b"/", b"/" + b"a" * 50])
def test_method_longer_than_any_is_501(target: bytes) -> None:
    """RFC 9112 3.1: a method longer than any the server implements SHOULD get 501 (not
    414: the target may be short). The proxy passes any token on, up to 32 bytes."""
    check_invalid_request(b"x" * 33 + b" " + target + b" HTTP/1.1\r\nHost: a\r\n\r\n", 501)
    check_invalid_request(b"x" * 10000 + b" " + target + b" HTTP/1.1\r\nHost: a\r\n\r\n",
                          501)


def test_parse_error_is_an_exception_with_status():
    e = ParseError(431, "too large")
    assert isinstance(e, Exception)
    assert e.status == 431 and e.message == "too large" and str(e) == "too large"


# --------------------------------------------------------------------------
# responses

VALID_RESPONSES = [
    pytest.param(
        resp(b"Content-Length: 3", b"Content-Type: text/plain"),
        dict(status=200, reason=b"OK", version=11, content_length=3, keep_alive=True,
             flags=[F_CONTENT_LENGTH, 0]),
        id="200-ok",
    ),
    pytest.param(b"HTTP/1.1 200\r\n\r\n", dict(status=200, reason=b"", headers=[]),
                 id="missing-reason"),
    pytest.param(b"HTTP/1.1 200 \r\n\r\n", dict(status=200, reason=b""), id="empty-reason"),
    pytest.param(resp(line=b"HTTP/1.1 404 Not  Found \t"),
                 dict(status=404, reason=b"Not  Found \t"), id="reason-kept-verbatim"),
    pytest.param(resp(line=b"HTTP/1.1 200 \xc3\x89t\xe9 \x80\xff"),
                 dict(reason=b"\xc3\x89t\xe9 \x80\xff"), id="reason-obs-text"),
    pytest.param(resp(line=b"HTTP/1.1 599 Whatever: 1 ; x"),
                 dict(status=599, reason=b"Whatever: 1 ; x"), id="599"),
    pytest.param(resp(line=b"HTTP/1.1 100 Continue"), dict(status=100, reason=b"Continue"),
                 id="100-continue"),
    pytest.param(resp(line=b"HTTP/1.1 103 Early Hints"), dict(status=103), id="103"),
    pytest.param(
        resp(b"Upgrade: websocket", b"Connection: Upgrade", b"Sec-WebSocket-Accept: x",
             line=b"HTTP/1.1 101 Switching Protocols"),
        dict(status=101, upgrade=b"websocket", connection_upgrade=True,
             flags=[F_UPGRADE | F_HOP | F_NAMED_BY_CONNECTION, F_CONNECTION | F_HOP, 0]),
        id="101-upgrade",
    ),
    pytest.param(resp(b"Upgrade: websocket", line=b"HTTP/1.1 101 Switching Protocols"),
                 dict(upgrade=None, connection_upgrade=False), id="101-without-connection"),
    pytest.param(resp(line=b"HTTP/1.1 204 No Content"),
                 dict(status=204, content_length=-1, chunked=False), id="204"),
    pytest.param(resp(b"Content-Length: 1234", b"ETag: \"x\"", line=b"HTTP/1.1 304 Not Modified"),
                 dict(status=304, content_length=1234), id="304-with-content-length"),
    pytest.param(resp(b"Transfer-Encoding: chunked"),
                 dict(chunked=True, content_length=-1, flags=[F_TRANSFER_ENCODING | F_HOP]),
                 id="chunked"),
    pytest.param(resp(b"Content-Length: 5, 5", b"Content-Length: 5"),
                 dict(content_length=5), id="duplicate-content-length"),
    pytest.param(resp(b"Connection: close"), dict(keep_alive=False), id="connection-close"),
    pytest.param(resp(line=b"HTTP/1.0 200 OK"), dict(version=10, keep_alive=False),
                 id="http10"),
    pytest.param(resp(b"Connection: keep-alive", b"Keep-Alive: timeout=5",
                      line=b"HTTP/1.0 200 OK"),
                 dict(version=10, keep_alive=True, flags=[F_CONNECTION | F_HOP, NAMED]),
                 id="http10-keep-alive"),
    pytest.param(resp(line=b"HTTP/1.7 200 OK"), dict(version=11), id="http1-higher-minor"),
    pytest.param(
        resp(b"Connection: x-private", b"X-Private: 1", b"Content-Length: 0",
             b"Proxy-Authenticate: Basic"),
        dict(flags=[F_CONNECTION | F_HOP, NAMED, F_CONTENT_LENGTH, F_HOP]),
        id="connection-named",
    ),
    pytest.param(resp(b"Set-Cookie: a=1", b"Set-Cookie: b=2", b"Host: not-required"),
                 dict(headers=[(b"Set-Cookie", b"a=1"), (b"Set-Cookie", b"b=2"),
                               (b"Host", b"not-required")]),
                 id="repeated-fields"),
    pytest.param(resp(b"Host: a", b"Host: b"), dict(flags=[F_HOST, F_HOST]),
                 id="host-not-checked-in-responses"),
]


@pytest.mark.parametrize(("data", "expected"), VALID_RESPONSES)
def test_valid_response(data, expected):
    h = check_valid_response(data)
    got = response_summary(h)
    for key, value in expected.items():
        assert got[key] == value, key


def test_response_get_and_serialize():
    h = check_valid_response(resp(b"Connection: keep-alive, X-Hop", b"X-Hop: 1",
                                  b"Content-Length: 2", b"Server: x"))
    assert h.get(b"server") == b"x"
    assert h.get(b"SERVER") == b"x"
    assert h.get_all(b"x-hop") == [b"1"]
    assert h.serialize(b"HTTP/1.1 200 OK\r\n", b"Via: 1.1 aiproxy\r\n", F_HOP) == (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nServer: x\r\nVia: 1.1 aiproxy\r\n\r\n")
    assert repr(h) == "<ResponseHead 200 HTTP/1.1>"


def test_response_limits():
    check_valid_response(resp(b"X: " + b"v" * 200), max_head=256)
    check_invalid_response(resp(b"X: " + b"v" * 300), max_head=256)
    check_invalid_response(b"HTTP/1.1 200 OK\r\nX: " + b"v" * 300, complete=False,
                           max_head=256)
    check_invalid_response(b"HTTP/1.1 200 " + b"r" * 300, complete=False, max_head=256)
    check_valid_response(resp(*[b"X: 1"] * 5), max_headers=5)
    check_invalid_response(resp(*[b"X: 1"] * 6), max_headers=5)


INVALID_RESPONSES = [
    pytest.param(b"HTTP/1.1 20 OK\r\n\r\n", id="status-two-digits"),
    pytest.param(b"HTTP/1.1 2000 OK\r\n\r\n", id="status-four-digits"),
    pytest.param(b"HTTP/1.1 abc OK\r\n\r\n", id="status-letters"),
    pytest.param(b"HTTP/1.1 2x0 OK\r\n\r\n", id="status-mixed"),
    pytest.param(b"HTTP/1.1 099 Low\r\n\r\n", id="status-below-100"),
    pytest.param(b"HTTP/1.1 000 Zero\r\n\r\n", id="status-zero"),
    pytest.param(b"HTTP/1.1 600 High\r\n\r\n", id="status-above-599"),
    pytest.param(b"HTTP/1.1  200 OK\r\n\r\n", id="two-spaces"),
    pytest.param(b"HTTP/1.1\t200 OK\r\n\r\n", id="tab-separator"),
    pytest.param(b"HTTP/1.1 200\tOK\r\n\r\n", id="tab-before-reason"),
    pytest.param(b"HTTP/1.1 200 OK\n\r\n", id="bare-lf-status-line"),
    pytest.param(b"HTTP/1.1 200\n\r\n", id="bare-lf-after-status"),
    pytest.param(b"HTTP/1.1 200 O\rK\r\n\r\n", id="bare-cr-in-reason"),
    pytest.param(b"HTTP/1.1 200 O\x00K\r\n\r\n", id="nul-in-reason"),
    pytest.param(b"HTTP/1.1 200 O\x7fK\r\n\r\n", id="del-in-reason"),
    pytest.param(b"HTTP/2.0 200 OK\r\n\r\n", id="http20"),
    pytest.param(b"HTTP/0.9 200 OK\r\n\r\n", id="http09"),
    pytest.param(b"HTTP/2 200 OK\r\n\r\n", id="http2-no-minor"),
    pytest.param(b"http/1.1 200 OK\r\n\r\n", id="lowercase-version"),
    pytest.param(b"HTTP/1.1x 200 OK\r\n\r\n", id="version-suffix"),
    pytest.param(b"ICY 200 OK\r\n\r\n", id="icy"),
    pytest.param(b"\r\nHTTP/1.1 200 OK\r\n\r\n", id="leading-crlf"),
    pytest.param(b"<html>\r\n\r\n", id="html"),
    pytest.param(resp(b"Content-Length: 5", b"Transfer-Encoding: chunked"), id="cl-and-te"),
    pytest.param(resp(b"Content-Length: 5", b"Content-Length: 6"), id="cl-differing"),
    pytest.param(resp(b"Content-Length: 5, 6"), id="cl-list-differing"),
    pytest.param(resp(b"Content-Length: -1"), id="cl-negative"),
    pytest.param(resp(b"Content-Length: 1" + b"0" * 18), id="cl-19-digits"),
    pytest.param(resp(b"Transfer-Encoding: gzip, chunked"), id="te-unsupported-501-to-502"),
    pytest.param(resp(b"Transfer-Encoding: chunked, chunked"), id="te-chunked-twice"),
    pytest.param(resp(b"Transfer-Encoding:"), id="te-empty"),
    pytest.param(resp(b"Transfer-Encoding: chunked", line=b"HTTP/1.0 200 OK"),
                 id="te-in-http10"),
    pytest.param(resp(b"X-A: b", b" folded"), id="obs-fold"),
    pytest.param(b"HTTP/1.1 200 OK\r\n X-A: b\r\n\r\n", id="ws-before-first-field"),
    pytest.param(resp(b"X-A : b"), id="space-before-colon"),
    pytest.param(resp(b": b"), id="empty-name"),
    pytest.param(resp(b"X(A): b"), id="bad-name"),
    pytest.param(resp(b"X-A: a\x00b"), id="nul-in-value"),
    pytest.param(resp(b"X-A: a\rb"), id="bare-cr-in-value"),
    pytest.param(b"HTTP/1.1 200 OK\r\nX-A: b\n\r\n", id="bare-lf-field-line"),
    pytest.param(b"HTTP/1.1 200 OK\r\nX-A: b\r\n\n", id="bare-lf-final-line"),
    pytest.param(resp(b"Connection: " + b",".join(b"x%d" % i for i in range(33))),
                 id="too-many-connection-options"),
]


@pytest.mark.parametrize("data", INVALID_RESPONSES)
def test_invalid_response(data):
    check_invalid_response(data)


# --------------------------------------------------------------------------
# chunked bodies


def _decode_pieces(pieces, **kw):
    """Feed pieces in order; return (payload, trailers, end offset in the whole stream)."""
    d = ChunkedDecoder(**kw)
    out = []
    pos = 0
    end = None
    for piece in pieces:
        if d.done:
            break
        got = d.feed(piece)
        assert isinstance(got, list)
        assert all(type(x) is bytes and x for x in got), got
        out.extend(got)
        if d.done:
            assert 0 < d.tail <= len(piece)
            end = pos + d.tail
        pos += len(piece)
    return b"".join(out), d.trailers, end, d


VALID_CHUNKED = [
    pytest.param(b"0\r\n\r\n", b"", b"", id="empty-body"),
    pytest.param(b"5\r\nhello\r\n0\r\n\r\n", b"hello", b"", id="one-chunk"),
    pytest.param(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", b"hello world", b"",
                 id="two-chunks"),
    pytest.param(b"1\r\na\r\n1\r\nb\r\n1\r\nc\r\n0\r\n\r\n", b"abc", b"", id="tiny-chunks"),
    pytest.param(b"A\r\n0123456789\r\n0\r\n\r\n", b"0123456789", b"", id="uppercase-hex"),
    pytest.param(b"a\r\n0123456789\r\n0\r\n\r\n", b"0123456789", b"", id="lowercase-hex"),
    pytest.param(b"1F\r\n" + b"x" * 31 + b"\r\n0\r\n\r\n", b"x" * 31, b"", id="mixed-hex"),
    pytest.param(b"0000000000000005\r\nhello\r\n0000000000000000\r\n\r\n", b"hello", b"",
                 id="16-hex-digits"),
    # chunk-size = 1*HEXDIG (RFC 9112 7.1): leading zeros are not significant digits.
    pytest.param(b"0" * 20 + b"5\r\nhello\r\n" + b"0" * 30 + b"\r\n\r\n", b"hello", b"",
                 id="leading-zeros-past-16"),
    pytest.param(b"4\r\n\r\n\r\n\r\n0\r\n\r\n", b"\r\n\r\n", b"", id="crlf-in-data"),
    pytest.param(b"3\r\n0\r\n\r\n0\r\n\r\n", b"0\r\n", b"", id="last-chunk-lookalike-in-data"),
    pytest.param(b"5\r\n\x00\xff\r\n\x7f\r\n0\r\n\r\n", b"\x00\xff\r\n\x7f", b"",
                 id="binary-data"),
    pytest.param(b"5;name=value\r\nhello\r\n0;last\r\n\r\n", b"hello", b"", id="extensions"),
    pytest.param(b"5;a=1;b;c=\"x\"\r\nhello\r\n0\r\n\r\n", b"hello", b"",
                 id="several-extensions"),
    pytest.param(b'5;a="b;c\\"d \\\\ e"\r\nhello\r\n0\r\n\r\n', b"hello", b"",
                 id="quoted-extension"),
    pytest.param(b"5 ;a=b\r\nhello\r\n0\t;x\r\n\r\n", b"hello", b"", id="bws-before-ext"),
    pytest.param(b"5; a = b\r\nhello\r\n0\r\n\r\n", b"hello", b"", id="bws-inside-ext"),
    pytest.param(b'5;x="\xff\xfe"\r\nhello\r\n0\r\n\r\n', b"hello", b"", id="obs-text-ext"),
    pytest.param(b"5;" + b"e" * 4000 + b"\r\nhello\r\n0\r\n\r\n", b"hello", b"",
                 id="long-extension"),
    pytest.param(b"0\r\nExpires: never\r\n\r\n", b"", b"Expires: never\r\n", id="trailer"),
    pytest.param(b"3\r\nabc\r\n0\r\nX-Sum: abc\r\nX-Other:\tv \r\n\r\n", b"abc",
                 b"X-Sum: abc\r\nX-Other:\tv \r\n", id="trailers"),
    pytest.param(b"0\r\nX-Empty:\r\n\r\n", b"", b"X-Empty:\r\n", id="empty-trailer-value"),
    pytest.param(b"0\r\nX-O: \x80\xff\r\n\r\n", b"", b"X-O: \x80\xff\r\n",
                 id="obs-text-trailer"),
]


def _all_splits(data):
    yield [data]
    yield [bytes([b]) for b in data]
    for k in range(len(data) + 1):
        yield [data[:k], data[k:]]


@pytest.mark.parametrize(("body", "payload", "trailers"), VALID_CHUNKED)
@pytest.mark.parametrize("after", [b"", b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", b"\x00garbage",
                                   b"0\r\n\r\n"])
def test_chunked_valid(body, payload, trailers, after):
    data = body + after
    splits = list(_all_splits(data))
    if len(data) < 64:  # every pair of split points for the short ones
        splits += [[data[:i], data[i:j], data[j:]]
                   for i in range(len(data) + 1) for j in range(i, len(data) + 1)]
    for pieces in splits:
        got, tr, end, d = _decode_pieces(pieces)
        assert d.done, pieces
        assert got == payload, pieces
        assert tr == trailers, pieces
        assert end == len(body), pieces
        assert data[end:] == after


def test_chunked_byte_by_byte_done_exactly_at_end():
    body = b"5;x=\"y\"\r\nhello\r\n0\r\nT: v\r\n\r\n"
    d = ChunkedDecoder()
    out = []
    for i in range(len(body)):
        assert not d.done
        out.extend(d.feed(body[i:i + 1]))
    assert d.done and d.tail == 1
    assert b"".join(out) == b"hello"
    assert d.trailers == b"T: v\r\n"


def test_chunked_buffer_types():
    body = b"5\r\nhello\r\n0\r\n\r\nNEXT"
    for buf in (body, bytearray(body), memoryview(body)):
        d = ChunkedDecoder()
        out = d.feed(buf)
        assert out == [b"hello"]
        assert all(type(x) is bytes for x in out)
        assert d.done and d.tail == len(body) - 4


def test_chunked_data_is_copied_from_mutable_buffers():
    buf = bytearray(b"5\r\nhello\r\n")
    d = ChunkedDecoder()
    out = d.feed(buf)
    buf[:] = b"X" * len(buf)
    assert out == [b"hello"]


def test_chunked_whole_bytes_passed_through():
    d = ChunkedDecoder()
    d.feed(b"5\r\n")
    piece = b"hello"
    assert d.feed(piece)[0] is piece  # zero-copy when a bytes object is all data
    assert d.feed(b"\r\n0\r\n\r\n") == []
    assert d.done


def test_chunked_large_chunk_streamed():
    d = ChunkedDecoder()
    assert d.feed(b"100000\r\n") == []
    total = 0
    for _ in range(16):
        got = d.feed(b"z" * 0x10000)
        total += sum(map(len, got))
    assert total == 0x100000
    assert not d.done
    assert d.feed(b"\r\n0\r\n\r\n") == []
    assert d.done and d.tail == 7


def test_chunked_size_of_16_significant_digits_behind_zeros():
    """The largest size (16 hex digits) behind 4,000 zeros: a size line within the
    bound, so the chunk's data follows."""
    d = ChunkedDecoder()
    assert d.feed(b"0" * 4000 + b"F" * 16 + b";a\r\n") == []
    assert d.feed(b"xyz") == [b"xyz"]
    assert not d.done


def test_chunked_empty_feed():
    d = ChunkedDecoder()
    assert d.feed(b"") == []
    assert not d.done
    d.feed(b"0\r\n\r\n")
    assert d.done and d.trailers == b""


def test_chunked_feed_after_done():
    d = ChunkedDecoder()
    d.feed(b"0\r\n\r\n")
    assert d.done
    for data in (b"x", b""):
        with pytest.raises(ParseError) as info:
            d.feed(data)
        assert info.value.status == 400


def test_chunked_trailer_limit():
    trailer = b"X-A: " + b"v" * 20 + b"\r\n"  # 27 bytes
    got, tr, end, d = _decode_pieces([b"0\r\n" + trailer + b"\r\n"], max_trailer=len(trailer))
    assert d.done and tr == trailer
    for pieces in _all_splits(b"0\r\n" + trailer + b"\r\n"):
        with pytest.raises(ParseError) as info:
            _decode_pieces(pieces, max_trailer=len(trailer) - 1)
        assert info.value.status == 431
    # default limit, while still incomplete
    with pytest.raises(ParseError) as info:
        _decode_pieces([b"0\r\nX: " + b"v" * 40000])
    assert info.value.status == 431


def test_chunked_trailer_field_count_limit():
    """Trailer fields are counted as header fields are (max_headers): 431 past the cap,
    however few bytes they take."""
    body = b"0\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(3)) + b"\r\n"
    got, tr, end, d = _decode_pieces([body], max_fields=3)
    assert d.done and tr.count(b"\r\n") == 3
    for pieces in _all_splits(body):
        with pytest.raises(ParseError) as info:
            _decode_pieces(pieces, max_fields=2)
        assert (info.value.status, info.value.message) == (431, "too many trailer fields")
    # default cap (100, as max_headers), while still incomplete
    with pytest.raises(ParseError) as info:
        _decode_pieces([b"0\r\n" + b"A:\r\n" * 101])
    assert info.value.status == 431
    with pytest.raises(ParseError) as info:
        _decode_pieces([b"0\r\n" + b"X: 1\r\n" * 6000])
    assert info.value.status == 431


INVALID_CHUNKED = [
    pytest.param(b"x\r\n", 400, id="non-hex-size"),
    pytest.param(b"5x\r\nhello\r\n0\r\n\r\n", 400, id="hex-then-junk"),
    pytest.param(b"g\r\n", 400, id="g"),
    pytest.param(b"\r\n", 400, id="empty-size"),
    pytest.param(b";ext\r\n", 400, id="extension-without-size"),
    pytest.param(b" 5\r\nhello\r\n", 400, id="leading-space"),
    pytest.param(b"+5\r\nhello\r\n", 400, id="plus"),
    pytest.param(b"-5\r\nhello\r\n", 400, id="minus"),
    pytest.param(b"0x5\r\nhello\r\n", 400, id="0x-prefix"),
    pytest.param(b"1" + b"0" * 16 + b"\r\n", 400, id="17-hex-digits"),
    pytest.param(b"0" * 17 + b"1" + b"0" * 16 + b"\r\n", 400, id="zeros-then-17-hex-digits"),
    # The size line is bounded like an extension: zeros or blanks do not go on forever.
    pytest.param(b"0" * 5000 + b"5\r\nhello\r\n", 400, id="size-line-of-zeros-too-long"),
    pytest.param(b"5" + b" " * 5000 + b";a\r\nhello\r\n", 400, id="size-line-of-blanks-too-long"),
    pytest.param(b"5\nhello\r\n0\r\n\r\n", 400, id="bare-lf-after-size"),
    pytest.param(b"5;a=b\nhello\r\n0\r\n\r\n", 400, id="bare-lf-after-extension"),
    pytest.param(b"5\rhello\r\n", 400, id="bare-cr-after-size"),
    pytest.param(b"5 \r\nhello\r\n", 400, id="trailing-space-without-extension"),
    pytest.param(b"5 5\r\nhello\r\n", 400, id="space-inside-size"),
    pytest.param(b"5\r\nhello\n0\r\n\r\n", 400, id="bare-lf-after-data"),
    pytest.param(b"5\r\nhello\r0\r\n\r\n", 400, id="bare-cr-after-data"),
    pytest.param(b"5\r\nhelloX\r\n0\r\n\r\n", 400, id="data-too-long"),
    pytest.param(b"5\r\nhell\r\n0\r\n\r\n", 400, id="data-too-short"),
    pytest.param(b"5\r\nhello0\r\n\r\n", 400, id="data-without-crlf"),
    pytest.param(b"5;" + b"e" * 5000 + b"\r\nhello\r\n", 400, id="extension-too-long"),
    pytest.param(b"5;a\x00\r\nhello\r\n", 400, id="nul-in-extension"),
    pytest.param(b"5;a\x7f\r\nhello\r\n", 400, id="del-in-extension"),
    # RFC 9112 7.1.1: ext-name is a token; ext-val a token or a quoted-string
    pytest.param(b"5;x=\xff\r\nhello\r\n", 400, id="obs-text-in-unquoted-ext"),
    pytest.param(b"5;\r\nhello\r\n", 400, id="ext-without-name"),
    pytest.param(b"5;a=\r\nhello\r\n", 400, id="ext-without-value"),
    pytest.param(b'5;a="b\r\nhello\r\n', 400, id="ext-unterminated-quote"),
    pytest.param(b'5;a="b"c\r\nhello\r\n', 400, id="ext-junk-after-quote"),
    pytest.param(b"5;a b\r\nhello\r\n", 400, id="ext-two-names"),
    pytest.param(b"5;a=(b)\r\nhello\r\n", 400, id="ext-value-not-a-token"),
    pytest.param(b"0\r\n\n", 400, id="bare-lf-after-last-chunk"),
    pytest.param(b"0\r\n\rX", 400, id="bare-cr-after-last-chunk"),
    pytest.param(b"0\n\r\n", 400, id="bare-lf-last-chunk-line"),
    pytest.param(b"0\r\nX-A: b\n\r\n", 400, id="bare-lf-in-trailer"),
    pytest.param(b"0\r\nX-A: b\rX\r\n\r\n", 400, id="bare-cr-in-trailer"),
    pytest.param(b"0\r\nX-A: \x00\r\n\r\n", 400, id="nul-in-trailer"),
    pytest.param(b"0\r\nX-A: b\r\n folded\r\n\r\n", 400, id="obs-fold-in-trailer"),
    pytest.param(b"0\r\n X-A: b\r\n\r\n", 400, id="ws-before-trailer"),
    pytest.param(b"0\r\n: b\r\n\r\n", 400, id="empty-trailer-name"),
    # RFC 9112 7.1.2: the trailer section is field lines (field-name ":" ...)
    pytest.param(b"0\r\nNoColon\r\n\r\n", 400, id="trailer-without-colon"),
    pytest.param(b"0\r\nX-A : b\r\n\r\n", 400, id="space-before-colon-in-trailer"),
    pytest.param(b"0\r\nX A: b\r\n\r\n", 400, id="space-in-trailer-name"),
    pytest.param(b"0\r\nX(A): b\r\n\r\n", 400, id="bad-trailer-name"),
    pytest.param(b"0\r\nX\x80: b\r\n\r\n", 400, id="obs-text-in-trailer-name"),
]


@pytest.mark.parametrize(("body", "status"), INVALID_CHUNKED)
def test_chunked_invalid(body, status):
    for pieces in _all_splits(body):
        with pytest.raises(ParseError) as info:
            _decode_pieces(pieces)
        assert info.value.status == status, pieces
    # byte by byte the error is raised before the body is ever reported done
    d = ChunkedDecoder()
    for i in range(len(body)):
        try:
            d.feed(body[i:i + 1])
        except ParseError:
            break
    else:  # pragma: no cover - failure path
        pytest.fail("never rejected")
    assert not d.done


@pytest.mark.parametrize("target", [
    b"/", b"/a", b"/a?x=%41", b"/a%41", b"/a/./b", b"/a/../b", b"/a?#", b"/a#b", b"/.x",
    b"/a?/.", b"/a./b", b"/a?b?c", b"/%", b"//x", b"/a/.", b"/?", b"*",
    b"http://h/p", b"https://h/p?q", b"/v1/chat/completions?stream=true",
])
def test_target_scan_matches_the_exchange_rules(target: bytes) -> None:
    # target_plain lets the exchange skip its own checks: it must be exactly "origin-form,
    # no '#', and a path part that needs_normalizing() would leave alone".
    head = parse_request(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n", 8192, 8192, 100)
    q = target.find(b"?")
    assert head.query_at == q
    path = target if q < 0 else target[:q]
    expected = (target[:1] == b"/" and target.find(b"#") < 0
                and not needs_normalizing(path))
    assert head.target_plain == expected


def one_byte_changed(fill: bytes, length: int):
    """(pos, byte, `length` fill bytes with `byte` at `pos`) for every position and every
    byte but CR and LF (line ends: covered by the framing tests)."""
    for pos in range(length):
        for byte in range(256):
            if byte in (0x0D, 0x0A):
                continue
            text = bytearray(fill * length)
            text[pos] = byte
            yield pos, byte, bytes(text)


@pytest.mark.parametrize("length", [1, 7, 8, 9, 15, 16, 17, 25, 31, 32, 33])
def test_every_byte_at_every_name_position(length: int) -> None:
    """Field names are scanned sixteen (SSE2) or eight bytes at a time: each byte value, at each position
    of names around the word size, is taken or refused as RFC 9110 5.6.2's tchar says.
    A ':' ends the name there (the rest is value); a name cannot be empty."""
    tchar = set(b"!#$%&'*+-.^_`|~0123456789") | set(range(ord("a"), ord("z") + 1)) | set(
        range(ord("A"), ord("Z") + 1))
    for pos, byte, name in one_byte_changed(b"n", length):
        line = name + b": v\r\n"
        msg = b"GET / HTTP/1.1\r\nHost: a\r\n" + line + b"\r\n"
        resp_msg = b"HTTP/1.1 200 OK\r\n" + line + b"\r\n"
        if byte in tchar or (byte == 0x3A and pos > 0):
            want = (name.lower(), b"v") if byte in tchar else (
                name[:pos], name[pos + 1:] + b": v")
            head = parse_request(msg)
            assert head is not None and head.get(want[0]) == want[1], (pos, byte)
            assert parse_response(resp_msg).get(want[0]) == want[1], (pos, byte)
        else:
            with pytest.raises(ParseError) as exc:
                parse_request(msg)
            assert exc.value.status == 400, (pos, byte)
            with pytest.raises(ParseError) as exc:
                parse_response(resp_msg)
            assert exc.value.status == 502, (pos, byte)


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33])
def test_every_byte_at_every_value_position(length: int) -> None:
    """Field values are scanned sixteen (SSE2) or eight bytes at a time: each byte value, at each position
    of values around the word size, is taken or refused as FVCHAR says (RFC 9110 5.5:
    VCHAR, obs-text, SP and HTAB; any other control byte is refused)."""
    allowed = set(range(0x20, 0x7F)) | set(range(0x80, 0x100)) | {0x09}
    for pos, byte, value in one_byte_changed(b"v", length):
        msg = b"GET / HTTP/1.1\r\nHost: a\r\nX-Test: " + value + b"\r\n\r\n"
        stripped = value.strip(b" \t")
        if byte in allowed:
            head = parse_request(msg)
            assert head is not None and head.get(b"x-test") == stripped, (pos, byte)
            resp = parse_response(b"HTTP/1.1 200 OK\r\nX-Test: " + value + b"\r\n\r\n")
            assert resp.get(b"x-test") == stripped, (pos, byte)
        else:
            with pytest.raises(ParseError) as exc:
                parse_request(msg)
            assert exc.value.status == 400, (pos, byte)
            with pytest.raises(ParseError) as exc:
                parse_response(b"HTTP/1.1 200 OK\r\nX-Test: " + value + b"\r\n\r\n")
            assert exc.value.status == 502, (pos, byte)


@pytest.mark.parametrize("n", [0, 1, 9, 15, 16, 255, 256, 4095, 65536, 2**31, 2**40 + 7])
def test_chunk_size_line_is_the_hex_size(n):
    from aiproxy._fast.h1 import chunk_size_line

    assert chunk_size_line(n) == b"%x\r\n" % n


@pytest.mark.parametrize("size", [1, 15, 16, 61, 255, 256, 2048, 70000])
def test_chunk_frame_decodes_to_its_data(size):
    from aiproxy._fast.h1 import chunk_frame

    data = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    frame = chunk_frame(data)
    assert frame == b"%x\r\n" % size + data + b"\r\n"
    dec = ChunkedDecoder()
    assert b"".join(dec.feed(frame + b"0\r\n\r\n")) == data and dec.done


@pytest.mark.parametrize(("fields", "present"), [
    (b"Content-Length: 0\r\n", False),
    (b"Keep-Alive: timeout=5, max=100\r\nContent-Length: 0\r\n", True),
    (b"Content-Length: 0\r\nKEEP-ALIVE: timeout=5\r\n", True),
    (b"Keep-Alives: x\r\nContent-Length: 0\r\n", False),
])
def test_keep_alive_field_flag(fields: bytes, present: bool) -> None:
    # h1_upstream reads the Keep-Alive hint only when the scan saw the field.
    resp = parse_response(b"HTTP/1.1 200 OK\r\n" + fields + b"\r\n")
    assert resp.keep_alive_field is present
    assert (resp.get(b"keep-alive") is not None) is present


# --------------------------------------------------------------------------
# Connection: keep-alive as the whole value takes a fast path in the scanner: it must
# record exactly what the general list splitter records for the same token.

_KA_SPELLINGS = [b"keep-alive", b"Keep-Alive", b"KEEP-ALIVE", b"  keep-alive \t"]


def _ka_summary(h, response):
    d = response_summary(h) if response else request_summary(h)
    for key in ("raw", "consumed", "headers", "target"):
        d.pop(key, None)
    return d


@pytest.mark.parametrize("response", [False, True], ids=["request", "response"])
@pytest.mark.parametrize("version", [b"1.0", b"1.1"])
@pytest.mark.parametrize("value", _KA_SPELLINGS)
def test_connection_keep_alive_fast_path_matches_list_split(response, version, value):
    if response:
        start, fields = b"HTTP/" + version + b" 200 OK\r\n", b"Content-Length: 0\r\n"
        parse = parse_response
    else:
        start, fields = b"GET / HTTP/" + version + b"\r\n", b"Host: a\r\n"
        parse = parse_request
    rest = b"Keep-Alive: timeout=5\r\nX-A: 1\r\n\r\n"
    fast = parse(start + fields + b"Connection: " + value + b"\r\n" + rest)
    # A trailing empty list element sends the same token through the general splitter.
    general = parse(start + fields + b"Connection: " + value.strip() + b",\r\n" + rest)
    assert _ka_summary(fast, response) == _ka_summary(general, response)
    assert fast.header_flags()[2] == NAMED  # the Keep-Alive field it names


def test_connection_keep_alive_fast_path_counts_toward_the_token_limit():
    many = b"".join(b"Connection: x%d\r\n" % i for i in range(32))
    for last in (b"keep-alive", b"keep-alive,"):
        exc = _raises(parse_request, b"GET / HTTP/1.1\r\nHost: a\r\n" + many
                      + b"Connection: " + last + b"\r\n\r\n", {})
        assert (exc.status, exc.message) == (400, "too many Connection options")
