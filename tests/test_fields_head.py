"""HTTP/2 request heads (protocols/fields.py) are Cython RequestHeads built from a field
list: every head method must answer as for the same request parsed from HTTP/1.1."""

from __future__ import annotations

import pytest
from aiproxy._fast.h1 import RequestHead, parse_request

from aiproxy.protocols.fields import (
    F_CONTENT_LENGTH,
    F_HOP,
    F_HOST,
    F_XFF,
    MalformedHead,
    h2_request_head,
)

H2 = [(b":method", b"POST"), (b":scheme", b"https"), (b":path", b"/v1/chat?x=1"),
      (b":authority", b"api.example"), (b"content-type", b"application/json"),
      (b"cookie", b"a=1"), (b"x-forwarded-for", b"10.0.0.1"), (b"cookie", b"b=2"),
      (b"content-length", b"12"), (b"te", b"trailers"), (b"proxy-authorization", b"x"),
      (b"accept", b"*/*"), (b"accept", b"text/plain")]


def test_h2_head_is_a_request_head_with_the_h2_facts() -> None:
    h = h2_request_head(H2, end_stream=False)
    assert type(h) is RequestHead
    assert (h.method, h.target, h.host, h.version) == (b"POST", b"/v1/chat?x=1",
                                                       b"api.example", 20)
    assert h.content_length == 12 and not h.chunked and h.keep_alive and h.upgrade is None
    assert h.has_xff and h.body_streamed and not h.target_plain and h.query_at == -1
    assert not h.expect_continue and not h.expect_unknown
    assert repr(h) == "<RequestHead b'POST' b'/v1/chat?x=1' HTTP/2>"
    without_length = [f for f in H2 if f[0] != b"content-length"]
    assert not h2_request_head(without_length, end_stream=True).body_streamed
    # RFC 9113 8.1.1: END_STREAM on the HEADERS frame, so no body, yet 12 announced.
    with pytest.raises(MalformedHead, match="content-length"):
        h2_request_head(H2, end_stream=True)


def test_h2_head_fields_answer_like_a_parsed_head() -> None:
    h = h2_request_head(H2, end_stream=False)
    # Cookies are joined (RFC 9113 8.2.3) and go last, as the HTTP/1.1 side expects.
    assert h.headers() == [(b"content-type", b"application/json"),
                           (b"x-forwarded-for", b"10.0.0.1"), (b"content-length", b"12"),
                           (b"te", b"trailers"), (b"proxy-authorization", b"x"),
                           (b"accept", b"*/*"), (b"accept", b"text/plain"),
                           (b"cookie", b"a=1; b=2")]
    assert h.get(b"accept") == b"*/*" and h.get(b"missing") is None
    assert h.get_all(b"accept") == [b"*/*", b"text/plain"]
    assert h.header_flags() == [0, F_XFF, F_CONTENT_LENGTH, F_HOP, F_HOP, 0, 0, 0]
    assert h.fields(F_HOP | F_CONTENT_LENGTH) == [
        (b"content-type", b"application/json"), (b"x-forwarded-for", b"10.0.0.1"),
        (b"accept", b"*/*"), (b"accept", b"text/plain"), (b"cookie", b"a=1; b=2")]
    out = h.serialize(b"POST /v1/chat?x=1 HTTP/1.1\r\n", b"Host: api.example\r\n",
                      F_HOP | F_CONTENT_LENGTH | F_XFF)
    assert out == (b"POST /v1/chat?x=1 HTTP/1.1\r\ncontent-type: application/json\r\n"
                   b"accept: */*\r\naccept: text/plain\r\ncookie: a=1; b=2\r\n"
                   b"Host: api.example\r\n\r\n")
    # What an HTTP/1.1 parser makes of that serialized head is the same request.
    again = parse_request(out, 65536, 8192, 100)
    assert again.get_all(b"accept") == h.get_all(b"accept")
    assert again.get(b"cookie") == h.get(b"cookie")


def test_host_field_when_there_is_no_authority() -> None:
    h = h2_request_head([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"),
                         (b"host", b"h.example")], end_stream=True)
    assert h.host == b"h.example" and h.header_flags() == [F_HOST]
    h = h2_request_head([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/")],
                        end_stream=True)
    assert h.host is None and h.headers() == [] and h.get(b"host") is None
    assert h.serialize(b"GET / HTTP/1.1\r\n", b"", 0) == b"GET / HTTP/1.1\r\n\r\n"


@pytest.mark.parametrize("fields, why", [
    ([(b":scheme", b"http"), (b":path", b"/")], "missing :method"),
    ([(b":method", b"GET"), (b":path", b"/")], "missing :path or :scheme"),
    ([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"x")], "invalid :path"),
    ([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b"a", b"1"),
      (b":authority", b"x")], "duplicate or misplaced pseudo-header"),
    ([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b":protocol", b"x")],
     "unknown pseudo-header"),
    ([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b":authority", b"a"),
      (b"host", b"b")], ":authority and host differ"),
    ([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"),
      (b"content-length", b"1"), (b"content-length", b"2")], "conflicting content-length"),
    ([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"),
      (b"content-length", b"-1")], "invalid content-length"),
])
def test_malformed_h2_requests_are_refused(fields: list, why: str) -> None:
    with pytest.raises(MalformedHead, match=why):
        h2_request_head(fields, end_stream=True)
