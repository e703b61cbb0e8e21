"""An h2spec-style conformance sweep of the HTTP/2 server side (RFC 9113, RFC 7541),
over h2c prior knowledge and TLS with ALPN h2.

h2spec is not available here, so its checks are rebuilt from raw frames (hyperframe,
hpack, tests/h2_support.FrameClient): each case sends frames wrong (or right) in one
way, then a PING probe, and checks the answer RFC 9113 asks for: a connection error is
GOAWAY with the code and the connection's end, a stream error is RST_STREAM with the
code on that stream alone (the connection still serves a request), an ignored frame
gets nothing but the probe's ACK. tests/test_h2_abuse.py covers the budgets and
floods; cases here overlap with its single-frame checks on purpose, as a catalogue."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from h2.errors import ErrorCodes
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
)

from tests.h2_support import PREFACE, FrameClient, ProxyProc, client_tls, make_pki, raw_frame

pytestmark = pytest.mark.timeout(60)

DATA, HEADERS, PRIORITY, RST, SETTINGS, PUSH, PING, GOAWAY, WU, CONT = range(10)
ES, EH, PAD, PRIO = 0x1, 0x4, 0x8, 0x20
PROBE = b"probe!!!"
ACKED = b"ackackac"  # the payload of a PING ACK from the client
E = ErrorCodes

CONFIG = """
[[listeners]]
name = "h2c"
address = "127.0.0.1:{h2c}"
protocols = ["h2c"]

[[listeners]]
name = "tls"
address = "127.0.0.1:{tls}"
protocols = ["h2", "http1"]
tls = { cert = "%s", key = "%s" }

[[clusters]]
name = "demo"
endpoints = ["127.0.0.1:%d"]

[[routes]]
name = "all"
cluster = "demo"
"""


@pytest.fixture(scope="module")
def proxy(demo_upstream: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProc]:
    tmp = tmp_path_factory.mktemp("h2-conformance")
    pki = make_pki(tmp / "pki")
    p = ProxyProc(tmp, CONFIG % (pki.cert, pki.key, demo_upstream), ("h2c", "tls"))
    yield p
    p.stop()  # fails the module if an exception escaped in the proxy


@pytest.fixture(params=["h2c", "tls"])
def connect(request: pytest.FixtureRequest, proxy: ProxyProc) -> Callable[[], FrameClient]:
    tls = client_tls() if request.param == "tls" else None
    port = proxy.ports[request.param]
    yield lambda: FrameClient(port, tls=tls)
    assert proxy.proc.poll() is None, proxy.log()[-5000:]


# -- frame builders --------------------------------------------------------------------

BASE = [(":method", "GET"), (":scheme", "http"), (":path", "/echo"), (":authority", "test")]


def S(*pairs: tuple[int, int]) -> bytes:
    return b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in pairs)


def blk(c: FrameClient, path: str = "/echo", method: str = "GET",
        extra: tuple | list = ()) -> bytes:
    return c.encode([(":method", method), (":scheme", "http"), (":path", path),
                     (":authority", "test"), *extra])


def H(c: FrameClient, sid: int, flags: int = ES | EH, **kw: Any) -> bytes:
    return raw_frame(HEADERS, flags, sid, blk(c, **kw))


def post(c: FrameClient, path: str = "/delay/300", **kw: Any) -> bytes:
    """An open request stream: HEADERS without END_STREAM."""
    return H(c, 1, EH, method="POST", path=path, **kw)


def fields(fs: list, end: bool = True) -> Callable[[FrameClient], list]:
    return lambda c: [raw_frame(HEADERS, EH | (ES if end else 0), 1, c.encode(fs))]


def without(name: str) -> list:
    return [f for f in BASE if f[0] != name]


def split(c: FrameClient, *tail: Callable[[bytes], bytes], path: str = "/echo") -> list:
    """HEADERS with the first 3 bytes of a block, then tail frames built from the rest."""
    b = blk(c, path=path)
    return [raw_frame(HEADERS, ES, 1, b[:3]), *(t(b[3:]) for t in tail)]


def wu(sid: int, n: int) -> bytes:
    return raw_frame(WU, 0, sid, n.to_bytes(4, "big"))


PRIO_PAYLOAD = bytes(4) + b"\x10"

# Expectations.
def GO(code: int) -> tuple:
    return ("goaway", code)


def RS(code: int, sid: int = 1) -> tuple:
    return ("reset", sid, code)


IGNORED = ("ignored",)
OK = ("status", 1, 200)
CLOSED = ("closed",)

# Modes: "" (handshake, frames, probe); "open" (a header block is left open: no probe);
# "raw" (no handshake, no probe); "after1"/"after5" (stream 1 or 5 served first).
CASES: dict[str, tuple[str, Callable[[FrameClient], list], tuple]] = {
    # 3.4 connection preface: an invalid one is a connection error (GOAWAY optional).
    "3.4/bad_preface": ("raw", lambda c: [b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n",
                                          raw_frame(SETTINGS, 0, 0, b"")], CLOSED),
    "3.4/preface_not_followed_by_settings": ("raw", lambda c: [PREFACE, raw_frame(
        PING, 0, 0, bytes(8))], GO(E.PROTOCOL_ERROR)),
    # 4.1 frame format: unknown types and flags, the reserved bit, are ignored.
    "4.1/unknown_type": ("", lambda c: [raw_frame(0x20, 0, 0, b"abc")], IGNORED),
    "4.1/unknown_flags_on_ping": ("", lambda c: [raw_frame(PING, 0x16, 0, b"12345678")],
                                  IGNORED),
    "4.1/reserved_bit_on_ping": ("", lambda c: [b"\0\0\x08" + bytes([PING, 0]) + b"\x80\0\0\0"
                                                + b"12345678"], IGNORED),
    "4.1/reserved_bit_on_headers": ("", lambda c: [(lambda b: len(b).to_bytes(3, "big") + bytes(
        [HEADERS, ES | EH]) + b"\x80\0\0\x01" + b)(blk(c))], OK),
    "4.1/unknown_flags_on_headers": ("", lambda c: [H(c, 1, ES | EH | 0xC2)], OK),
    # 4.2 frame size
    "4.2/data_of_max_frame_size": ("", lambda c: [post(c, "/echo"), raw_frame(
        DATA, ES, 1, b"x" * 16384)], OK),
    "4.2/data_over_max_frame_size": ("", lambda c: [post(c), raw_frame(DATA, ES, 1, b"x" * 16385)],
                                     GO(E.FRAME_SIZE_ERROR)),
    "4.2/headers_over_max_frame_size": ("", lambda c: [raw_frame(HEADERS, ES | EH, 1,
                                                                 bytes(16385))],
                                        GO(E.FRAME_SIZE_ERROR)),
    # 4.3 header compression and the header block's continuity
    "4.3/invalid_hpack": ("", lambda c: [raw_frame(HEADERS, ES | EH, 1, b"\x40")],
                          GO(E.COMPRESSION_ERROR)),
    "4.3/priority_inside_header_block": ("open", lambda c: [raw_frame(HEADERS, ES, 1, blk(c)),
                                                            raw_frame(PRIORITY, 0, 1,
                                                                      PRIO_PAYLOAD)],
                                         GO(E.PROTOCOL_ERROR)),
    "4.3/headers_of_other_stream_inside_block": ("open", lambda c: [
        raw_frame(HEADERS, ES, 1, blk(c)), H(c, 3)], GO(E.PROTOCOL_ERROR)),
    "4.3/ping_inside_header_block": ("open", lambda c: [raw_frame(HEADERS, ES, 1, blk(c)),
                                                        raw_frame(PING, 0, 0, bytes(8))],
                                     GO(E.PROTOCOL_ERROR)),
    # RFC 7541 (h2spec's hpack group): all COMPRESSION_ERROR.
    "hpack/index_0": ("", lambda c: [raw_frame(HEADERS, ES | EH, 1, b"\x80")],
                      GO(E.COMPRESSION_ERROR)),
    "hpack/index_past_tables": ("", lambda c: [raw_frame(HEADERS, ES | EH, 1, b"\xbf")],
                                GO(E.COMPRESSION_ERROR)),
    "hpack/name_index_past_tables": ("", lambda c: [raw_frame(HEADERS, ES | EH, 1,
                                                              b"\x7f\x10\x01a")],
                                     GO(E.COMPRESSION_ERROR)),
    "hpack/table_size_update_over_setting": ("", lambda c: [raw_frame(
        HEADERS, ES | EH, 1, b"\x3f\xe2\x1f" + blk(c))], GO(E.COMPRESSION_ERROR)),
    "hpack/table_size_update_at_end": ("", lambda c: [raw_frame(HEADERS, ES | EH, 1,
                                                                blk(c) + b"\x20")],
                                       GO(E.COMPRESSION_ERROR)),
    "hpack/huffman_with_eos": ("", lambda c: [raw_frame(HEADERS, ES | EH, 1, c.encode(BASE)
                                                        + b"\x40\x81\x41\x84\xff\xff\xff\xff")],
                               GO(E.COMPRESSION_ERROR)),
    "hpack/huffman_padding_over_7_bits": ("", lambda c: [raw_frame(
        HEADERS, ES | EH, 1, c.encode(BASE) + b"\x40\x81\x41\x82\x1f\xff")],
        GO(E.COMPRESSION_ERROR)),
    "hpack/huffman_padding_not_eos": ("", lambda c: [raw_frame(
        HEADERS, ES | EH, 1, c.encode(BASE) + b"\x40\x81\x41\x81\x18")],
        GO(E.COMPRESSION_ERROR)),
    "hpack/truncated_string": ("", lambda c: [raw_frame(HEADERS, ES | EH, 1,
                                                        c.encode(BASE) + b"\x40\x05ab")],
                               GO(E.COMPRESSION_ERROR)),
    "hpack/truncated_integer": ("", lambda c: [raw_frame(HEADERS, ES | EH, 1,
                                                         c.encode(BASE) + b"\x7f")],
                                GO(E.COMPRESSION_ERROR)),
    # 5.1 stream states
    "5.1/idle_data": ("", lambda c: [raw_frame(DATA, 0, 1, b"x")], GO(E.PROTOCOL_ERROR)),
    "5.1/idle_rst_stream": ("", lambda c: [raw_frame(RST, 0, 1, bytes(4))],
                            GO(E.PROTOCOL_ERROR)),
    "5.1/idle_window_update": ("", lambda c: [wu(1, 1)], GO(E.PROTOCOL_ERROR)),
    "5.1/idle_continuation": ("", lambda c: [raw_frame(CONT, EH, 1, blk(c))],
                              GO(E.PROTOCOL_ERROR)),
    "5.1/idle_priority": ("", lambda c: [raw_frame(PRIORITY, 0, 9, PRIO_PAYLOAD)], IGNORED),
    "5.1/half_closed_remote_data": ("", lambda c: [H(c, 1, path="/delay/300"),
                                                   raw_frame(DATA, ES, 1, b"x")],
                                    RS(E.STREAM_CLOSED)),
    "5.1/half_closed_remote_headers": ("", lambda c: [H(c, 1, path="/delay/300"), H(c, 1)],
                                       RS(E.STREAM_CLOSED)),
    "5.1/half_closed_remote_continuation": ("", lambda c: [H(c, 1, path="/delay/300"),
                                                           raw_frame(CONT, EH, 1, blk(c))],
                                            GO(E.PROTOCOL_ERROR)),
    "5.1/half_closed_remote_window_update": ("", lambda c: [H(c, 1), wu(1, 1)], OK),
    "5.1/half_closed_remote_priority": ("", lambda c: [H(c, 1), raw_frame(
        PRIORITY, 0, 1, PRIO_PAYLOAD)], OK),
    # After the client's RST_STREAM: a stream error STREAM_CLOSED (PRIORITY aside).
    "5.1/data_after_client_rst": ("", lambda c: [post(c), raw_frame(RST, 0, 1, bytes(3) + b"\x08"),
                                                 raw_frame(DATA, ES, 1, b"x")],
                                  RS(E.STREAM_CLOSED)),
    "5.1/headers_after_client_rst": ("", lambda c: [post(c), raw_frame(RST, 0, 1,
                                                                       bytes(3) + b"\x08"),
                                                    H(c, 1)], RS(E.STREAM_CLOSED)),
    # After END_STREAM both ways: a connection error STREAM_CLOSED.
    "5.1/closed_data": ("after1", lambda c: [raw_frame(DATA, ES, 1, b"x")],
                        GO(E.STREAM_CLOSED)),
    "5.1/closed_headers": ("after1", lambda c: [H(c, 1)], GO(E.STREAM_CLOSED)),
    "5.1/closed_continuation": ("after1", lambda c: [raw_frame(CONT, EH, 1, blk(c))],
                                GO(E.PROTOCOL_ERROR)),
    "5.1/closed_priority": ("after1", lambda c: [raw_frame(PRIORITY, 0, 1, PRIO_PAYLOAD)],
                            IGNORED),
    "5.1/closed_window_update": ("after1", lambda c: [wu(1, 1)], IGNORED),
    "5.1/closed_rst_stream": ("after1", lambda c: [raw_frame(RST, 0, 1, bytes(4))], IGNORED),
    # After the server's own RST_STREAM, frames in flight are ignored (no second reset).
    "5.1/data_after_server_rst": ("", lambda c: [
        post(c, extra=[("content-length", "1"), ("content-length", "2")]),
        raw_frame(DATA, 0, 1, b"x"), raw_frame(DATA, ES, 1, b"y")], RS(E.PROTOCOL_ERROR)),
    "5.1/trailers_after_server_rst": ("", lambda c: [
        post(c, extra=[("x-A", "1")]), raw_frame(DATA, 0, 1, b"x"),
        raw_frame(HEADERS, ES | EH, 1, c.encode([("x-t", "1")]))], RS(E.PROTOCOL_ERROR)),
    "5.1/data_after_server_rst_for_half_closed": ("", lambda c: [
        H(c, 1, path="/delay/300"), raw_frame(DATA, 0, 1, b"x"), raw_frame(DATA, ES, 1, b"y")],
        RS(E.STREAM_CLOSED)),
    # 5.1.1 stream identifiers
    "5.1.1/even_stream_id": ("", lambda c: [H(c, 2)], GO(E.PROTOCOL_ERROR)),
    "5.1.1/decreasing_stream_id": ("after5", lambda c: [H(c, 3)], GO(E.PROTOCOL_ERROR)),
    "5.1.1/priority_on_higher_id_then_lower_headers": ("", lambda c: [
        raw_frame(PRIORITY, 0, 9, PRIO_PAYLOAD), H(c, 1)], OK),
    # 5.3.1: depending on itself is a stream error PROTOCOL_ERROR.
    "5.3.1/headers_depends_on_itself": ("", lambda c: [raw_frame(
        HEADERS, ES | EH | PRIO, 1, (1).to_bytes(4, "big") + b"\x10" + blk(c))],
        RS(E.PROTOCOL_ERROR)),
    "5.3.1/priority_depends_on_itself": ("", lambda c: [H(c, 1, path="/delay/300"), raw_frame(
        PRIORITY, 0, 1, (1).to_bytes(4, "big") + b"\x10")], RS(E.PROTOCOL_ERROR)),
    # 5.5 extensions
    "5.5/unknown_frame_on_stream": ("", lambda c: [H(c, 1, EH, method="POST", path="/echo"),
                                                   raw_frame(0xAA, 0, 1, b"xx"),
                                                   raw_frame(DATA, ES, 1, b"")], OK),
    "5.5/unknown_frame_inside_header_block": ("open", lambda c: [
        raw_frame(HEADERS, ES, 1, blk(c)), raw_frame(0xAA, 0, 1, b"xx"),
        raw_frame(CONT, EH, 1, b"")], GO(E.PROTOCOL_ERROR)),
    # 6.1 DATA
    "6.1/data_on_stream_0": ("", lambda c: [raw_frame(DATA, 0, 0, b"x")], GO(E.PROTOCOL_ERROR)),
    "6.1/padding_longer_than_payload": ("", lambda c: [post(c), raw_frame(
        DATA, PAD | ES, 1, b"\x06abcd")], GO(E.PROTOCOL_ERROR)),
    "6.1/padding_as_long_as_payload": ("", lambda c: [post(c), raw_frame(
        DATA, PAD | ES, 1, b"\x05abcd")], GO(E.PROTOCOL_ERROR)),
    "6.1/padding_all_but_the_pad_length": ("", lambda c: [post(c, "/echo"), raw_frame(
        DATA, PAD | ES, 1, b"\x04abcd")], OK),
    "6.1/padding": ("", lambda c: [post(c, "/echo"), raw_frame(DATA, PAD | ES, 1,
                                                               b"\x02abXY")], OK),
    # 6.2 HEADERS
    "6.2/headers_on_stream_0": ("", lambda c: [H(c, 0)], GO(E.PROTOCOL_ERROR)),
    "6.2/padding_longer_than_payload": ("", lambda c: [raw_frame(
        HEADERS, ES | EH | PAD, 1, b"\xff" + blk(c))], GO(E.PROTOCOL_ERROR)),
    "6.2/padding": ("", lambda c: [raw_frame(HEADERS, ES | EH | PAD, 1,
                                             b"\x03" + blk(c) + bytes(3))], OK),
    "6.2/priority_flag": ("", lambda c: [raw_frame(HEADERS, ES | EH | PRIO, 1,
                                                   PRIO_PAYLOAD + blk(c))], OK),
    # Padding may take all of the fragment (a CONTINUATION carries the block), not more:
    # not the priority fields (hyperframe refused the first and allowed the second).
    "6.2/padding_is_all_of_the_fragment": ("", lambda c: [
        raw_frame(HEADERS, ES | PAD, 1, b"\x03" + bytes(3)), raw_frame(CONT, EH, 1, blk(c))],
        OK),
    "6.2/padding_is_all_of_the_fragment_with_priority": ("", lambda c: [
        raw_frame(HEADERS, ES | PAD | PRIO, 1, b"\x03" + PRIO_PAYLOAD + bytes(3)),
        raw_frame(CONT, EH, 1, blk(c))], OK),
    "6.2/padding_over_the_priority_fields": ("open", lambda c: [
        raw_frame(HEADERS, ES | PAD | PRIO, 1, b"\x03" + PRIO_PAYLOAD),
        raw_frame(CONT, EH, 1, blk(c))], GO(E.PROTOCOL_ERROR)),
    "6.2/padding_over_the_priority_fields_and_fragment": ("", lambda c: [
        (lambda b: raw_frame(HEADERS, ES | EH | PAD | PRIO, 1, bytes([len(b) + 2])
                             + PRIO_PAYLOAD + b))(blk(c))], GO(E.PROTOCOL_ERROR)),
    "6.2/priority_flag_too_short": ("", lambda c: [raw_frame(HEADERS, ES | EH | PRIO, 1,
                                                             b"\0\0")],
                                    GO(E.FRAME_SIZE_ERROR)),
    # 6.3 PRIORITY
    "6.3/priority_on_stream_0": ("", lambda c: [raw_frame(PRIORITY, 0, 0, PRIO_PAYLOAD)],
                                 GO(E.PROTOCOL_ERROR)),
    "6.3/priority_wrong_length": ("", lambda c: [H(c, 1, path="/delay/300"), raw_frame(
        PRIORITY, 0, 1, bytes(4))], RS(E.FRAME_SIZE_ERROR)),
    # 6.4 RST_STREAM
    "6.4/rst_stream_on_stream_0": ("", lambda c: [raw_frame(RST, 0, 0, bytes(4))],
                                   GO(E.PROTOCOL_ERROR)),
    "6.4/rst_stream_wrong_length": ("", lambda c: [H(c, 1, path="/delay/300"),
                                                   raw_frame(RST, 0, 1, bytes(3))],
                                    GO(E.FRAME_SIZE_ERROR)),
    "6.4/rst_stream_unknown_code": ("", lambda c: [post(c), raw_frame(RST, 0, 1,
                                                                      b"\0\0\0\xff")], IGNORED),
    # 6.5 SETTINGS
    "6.5/ack_with_payload": ("", lambda c: [raw_frame(SETTINGS, 1, 0, S((3, 10)))],
                             GO(E.FRAME_SIZE_ERROR)),
    "6.5/on_a_stream": ("", lambda c: [raw_frame(SETTINGS, 0, 1, b"")], GO(E.PROTOCOL_ERROR)),
    "6.5/length_not_multiple_of_6": ("", lambda c: [raw_frame(SETTINGS, 0, 0, b"\0\x03\0")],
                                     GO(E.FRAME_SIZE_ERROR)),
    "6.5.2/enable_push_2": ("", lambda c: [raw_frame(SETTINGS, 0, 0, S((2, 2)))],
                            GO(E.PROTOCOL_ERROR)),
    "6.5.2/enable_push_1": ("", lambda c: [raw_frame(SETTINGS, 0, 0, S((2, 1)))], IGNORED),
    "6.5.2/initial_window_size_over_max": ("", lambda c: [raw_frame(SETTINGS, 0, 0,
                                                                    S((4, 2**31)))],
                                           GO(E.FLOW_CONTROL_ERROR)),
    "6.5.2/max_frame_size_too_small": ("", lambda c: [raw_frame(SETTINGS, 0, 0,
                                                                S((5, 16383)))],
                                       GO(E.PROTOCOL_ERROR)),
    "6.5.2/max_frame_size_too_large": ("", lambda c: [raw_frame(SETTINGS, 0, 0,
                                                                S((5, 2**24)))],
                                       GO(E.PROTOCOL_ERROR)),
    "6.5.2/unknown_setting": ("", lambda c: [raw_frame(SETTINGS, 0, 0, S((0xFF, 1)))],
                              IGNORED),
    "6.5.2/enable_connect_protocol_2": ("", lambda c: [raw_frame(SETTINGS, 0, 0, S((8, 2)))],
                                        GO(E.PROTOCOL_ERROR)),
    # 6.7 PING (an ACK is not answered: the probe's ACK must be the only one)
    "6.7/ping_ack_not_answered": ("", lambda c: [raw_frame(PING, 1, 0, ACKED)], IGNORED),
    "6.7/ping_on_a_stream": ("", lambda c: [raw_frame(PING, 0, 1, bytes(8))],
                             GO(E.PROTOCOL_ERROR)),
    "6.7/ping_wrong_length": ("", lambda c: [raw_frame(PING, 0, 0, bytes(6))],
                              GO(E.FRAME_SIZE_ERROR)),
    # 6.8 GOAWAY
    "6.8/goaway_on_a_stream": ("", lambda c: [raw_frame(GOAWAY, 0, 1, bytes(8))],
                               GO(E.PROTOCOL_ERROR)),
    "6.8/goaway_too_short": ("", lambda c: [raw_frame(GOAWAY, 0, 0, bytes(4))],
                             GO(E.FRAME_SIZE_ERROR)),
    "7/goaway_unknown_code_lets_stream_finish": ("", lambda c: [H(c, 1), raw_frame(
        GOAWAY, 0, 0, (1).to_bytes(4, "big") + b"\0\0\x12\x34")], OK),
    # 6.9 WINDOW_UPDATE
    "6.9/increment_0_on_connection": ("", lambda c: [wu(0, 0)], GO(E.PROTOCOL_ERROR)),
    "6.9/increment_0_on_stream": ("", lambda c: [H(c, 1, path="/delay/300"), wu(1, 0)],
                                  RS(E.PROTOCOL_ERROR)),
    "6.9/wrong_length": ("", lambda c: [raw_frame(WU, 0, 0, bytes(3))], GO(E.FRAME_SIZE_ERROR)),
    "6.9/wrong_length_on_stream": ("", lambda c: [H(c, 1, path="/delay/300"),
                                                  raw_frame(WU, 0, 1, bytes(5))],
                                   GO(E.FRAME_SIZE_ERROR)),
    "6.9.1/connection_window_over_max": ("", lambda c: [wu(0, 2**30), wu(0, 2**30)],
                                         GO(E.FLOW_CONTROL_ERROR)),
    "6.9.1/stream_window_over_max": ("", lambda c: [H(c, 1, path="/delay/300"),
                                                    wu(1, 2**31 - 1)],
                                     RS(E.FLOW_CONTROL_ERROR)),
    "6.9.2/initial_window_size_overflows_open_stream": ("", lambda c: [
        H(c, 1, path="/delay/300"), wu(1, 2**31 - 1 - 65535),
        raw_frame(SETTINGS, 0, 0, S((4, 65536)))], GO(E.FLOW_CONTROL_ERROR)),
    # 6.10 CONTINUATION
    "6.10/continuations": ("", lambda c: split(c, lambda b: raw_frame(CONT, 0, 1, b[:3]),
                                              lambda b: raw_frame(CONT, EH, 1, b[3:])), OK),
    "6.10/data_inside_header_block": ("open", lambda c: split(
        c, lambda b: raw_frame(CONT, 0, 1, b), lambda b: raw_frame(DATA, 0, 1, b"x")),
        GO(E.PROTOCOL_ERROR)),
    "6.10/continuation_on_stream_0": ("open", lambda c: split(
        c, lambda b: raw_frame(CONT, EH, 0, b)), GO(E.PROTOCOL_ERROR)),
    "6.10/continuation_on_other_stream": ("open", lambda c: split(
        c, lambda b: raw_frame(CONT, EH, 3, b)), GO(E.PROTOCOL_ERROR)),
    "6.10/continuation_after_end_headers": ("", lambda c: [H(c, 1, path="/delay/300"),
                                                           raw_frame(CONT, EH, 1, blk(c))],
                                            GO(E.PROTOCOL_ERROR)),
    "6.10/continuation_after_data": ("", lambda c: [post(c), raw_frame(DATA, 0, 1, b"x"),
                                                    raw_frame(CONT, EH, 1, b"")],
                                     GO(E.PROTOCOL_ERROR)),
    # 8.1 message framing: trailers end the stream; content-length matches the DATA.
    "8.1/second_headers_without_end_stream": ("", lambda c: [post(c), raw_frame(
        HEADERS, EH, 1, c.encode([("x-t", "1")]))], RS(E.PROTOCOL_ERROR)),
    "8.1/trailers_without_end_stream": ("", lambda c: [post(c), raw_frame(DATA, 0, 1, b"x"),
                                                       raw_frame(HEADERS, EH, 1,
                                                                 c.encode([("x-t", "1")]))],
                                        RS(E.PROTOCOL_ERROR)),
    "8.1/trailers_with_pseudo_field": ("", lambda c: [post(c), raw_frame(
        HEADERS, EH | ES, 1, c.encode([(":path", "/x")]))], RS(E.PROTOCOL_ERROR)),
    "8.1/trailers": ("", lambda c: [post(c, "/echo"), raw_frame(DATA, 0, 1, b"x"), raw_frame(
        HEADERS, EH | ES, 1, c.encode([("x-t", "1")]))], OK),
    "8.1.1/content_length_over_in_one_frame": ("", lambda c: [
        post(c, "/echo", extra=[("content-length", "1")]), raw_frame(DATA, ES, 1, b"xyz")],
        RS(E.PROTOCOL_ERROR)),
    "8.1.1/content_length_over_in_two_frames": ("", lambda c: [
        post(c, "/echo", extra=[("content-length", "3")]), raw_frame(DATA, 0, 1, b"xy"),
        raw_frame(DATA, ES, 1, b"zw")], RS(E.PROTOCOL_ERROR)),
    "8.1.1/content_length_short": ("", lambda c: [
        post(c, "/echo", extra=[("content-length", "5")]), raw_frame(DATA, ES, 1, b"xyz")],
        RS(E.PROTOCOL_ERROR)),
    "8.1.1/content_length_without_data": ("", lambda c: [H(c, 1, method="POST", extra=[
        ("content-length", "5")])], RS(E.PROTOCOL_ERROR)),
    "8.1.1/content_length_not_a_number": ("", lambda c: [H(c, 1, method="POST", extra=[
        ("content-length", "abc")])], RS(E.PROTOCOL_ERROR)),
    # 8.2 field validity
    "8.2/uppercase_name": ("", fields(BASE + [("X-A", "1")]), RS(E.PROTOCOL_ERROR)),
    "8.2/empty_name": ("", fields(BASE + [("", "x")]), RS(E.PROTOCOL_ERROR)),
    "8.2/name_with_colon": ("", fields(BASE + [("x:a", "1")]), RS(E.PROTOCOL_ERROR)),
    "8.2/name_with_nul": ("", fields(BASE + [("x\0a", "1")]), RS(E.PROTOCOL_ERROR)),
    "8.2/name_with_space": ("", fields(BASE + [("x a", "1")]), RS(E.PROTOCOL_ERROR)),
    "8.2/name_with_del": ("", fields(BASE + [("x\x7fa", "1")]), RS(E.PROTOCOL_ERROR)),
    "8.2/name_not_ascii": ("", fields(BASE + [(b"x\xc3a", b"1")]), RS(E.PROTOCOL_ERROR)),
    "8.2/connection": ("", fields(BASE + [("connection", "close")]), RS(E.PROTOCOL_ERROR)),
    "8.2/keep_alive": ("", fields(BASE + [("keep-alive", "1")]), RS(E.PROTOCOL_ERROR)),
    "8.2/proxy_connection": ("", fields(BASE + [("proxy-connection", "1")]),
                             RS(E.PROTOCOL_ERROR)),
    "8.2/transfer_encoding": ("", fields(BASE + [("transfer-encoding", "chunked")]),
                              RS(E.PROTOCOL_ERROR)),
    "8.2/upgrade": ("", fields(BASE + [("upgrade", "h2c")]), RS(E.PROTOCOL_ERROR)),
    "8.2/te_gzip": ("", fields(BASE + [("te", "gzip")]), RS(E.PROTOCOL_ERROR)),
    "8.2/te_trailers": ("", fields(BASE + [("te", "trailers")]), OK),
    "8.2/value_with_cr": ("", fields(BASE + [("x-a", "a\rb")]), RS(E.PROTOCOL_ERROR)),
    "8.2/value_with_lf": ("", fields(BASE + [("x-a", "a\nb")]), RS(E.PROTOCOL_ERROR)),
    "8.2/value_with_nul": ("", fields(BASE + [("x-a", "a\0b")]), RS(E.PROTOCOL_ERROR)),
    "8.2/value_leading_space": ("", fields(BASE + [("x-a", " a")]), RS(E.PROTOCOL_ERROR)),
    "8.2/value_trailing_tab": ("", fields(BASE + [("x-a", "a\t")]), RS(E.PROTOCOL_ERROR)),
    "8.2/value_only_space": ("", fields(BASE + [("x-a", " ")]), RS(E.PROTOCOL_ERROR)),
    "8.2/value_inner_space": ("", fields(BASE + [("x-a", "a b")]), OK),
    "8.2/value_empty": ("", fields(BASE + [("x-a", "")]), OK),
    "8.2/value_not_ascii": ("", fields(BASE + [(b"x-a", b"caf\xc3\xa9")]), OK),
    "8.2/cookie_in_two_fields": ("", fields(BASE + [("cookie", "a=1"), ("cookie", "b=2")]), OK),
    # 8.3 pseudo-header fields
    "8.3/no_method": ("", fields(without(":method")), RS(E.PROTOCOL_ERROR)),
    "8.3/no_scheme": ("", fields(without(":scheme")), RS(E.PROTOCOL_ERROR)),
    "8.3/no_path": ("", fields(without(":path")), RS(E.PROTOCOL_ERROR)),
    "8.3/no_authority_nor_host": ("", fields(without(":authority")), RS(E.PROTOCOL_ERROR)),
    "8.3/host_instead_of_authority": ("", fields(without(":authority") + [("host", "test")]),
                                      OK),
    # Host names the same entity as :authority once normalized (RFC 3986 6.2): case,
    # the scheme's default port; another port is another entity.
    "8.3/host_in_other_case": ("", fields(BASE + [("host", "TEST")]), OK),
    "8.3/host_with_default_port": ("", fields(BASE + [("host", "test:80")]), OK),
    "8.3/host_with_empty_port": ("", fields(BASE + [("host", "Test:")]), OK),
    "8.3/host_with_other_port": ("", fields(BASE + [("host", "test:8080")]),
                                 RS(E.PROTOCOL_ERROR)),
    "8.3/host_https_port_on_http": ("", fields(BASE + [("host", "test:443")]),
                                    RS(E.PROTOCOL_ERROR)),
    "8.3/duplicate_method": ("", fields(BASE + [(":method", "GET")]), RS(E.PROTOCOL_ERROR)),
    "8.3/duplicate_scheme": ("", fields(BASE[:2] + [(":scheme", "http")] + BASE[2:]),
                             RS(E.PROTOCOL_ERROR)),
    "8.3/duplicate_path": ("", fields(BASE[:3] + [(":path", "/x")] + BASE[3:]),
                           RS(E.PROTOCOL_ERROR)),
    "8.3/duplicate_authority": ("", fields(BASE + [(":authority", "test")]),
                                RS(E.PROTOCOL_ERROR)),
    "8.3/unknown_pseudo": ("", fields(BASE + [(":foo", "x")]), RS(E.PROTOCOL_ERROR)),
    "8.3/status_in_request": ("", fields(BASE + [(":status", "200")]), RS(E.PROTOCOL_ERROR)),
    "8.3/protocol_without_extended_connect": ("", fields(BASE + [(":protocol", "websocket")]),
                                              RS(E.PROTOCOL_ERROR)),
    "8.3/uppercase_pseudo": ("", fields([(":Method", "GET")] + BASE[1:]),
                             RS(E.PROTOCOL_ERROR)),
    "8.3/pseudo_after_regular": ("", fields(BASE[:3] + [("x-a", "1"), (":authority", "test")]),
                                 RS(E.PROTOCOL_ERROR)),
    "8.3/pseudo_in_trailers": ("", lambda c: [post(c), raw_frame(
        HEADERS, ES | EH, 1, c.encode([(":authority", "test")]))], RS(E.PROTOCOL_ERROR)),
    "8.3/empty_path": ("", fields(without(":path") + [(":path", "")]), RS(E.PROTOCOL_ERROR)),
    "8.3/path_not_absolute": ("", fields(without(":path") + [(":path", "echo")]),
                              RS(E.PROTOCOL_ERROR)),
    "8.3/asterisk_path_not_options": ("", fields(without(":path") + [(":path", "*")]),
                                      RS(E.PROTOCOL_ERROR)),
    "8.3/authority_with_userinfo": ("", fields(without(":authority") + [(":authority",
                                                                         "u@test")]),
                                    RS(E.PROTOCOL_ERROR)),
    "8.3/empty_method": ("", fields([(":method", "")] + BASE[1:]), RS(E.PROTOCOL_ERROR)),
    "8.3/empty_scheme": ("", fields(BASE[:1] + [(":scheme", "")] + BASE[2:]),
                         RS(E.PROTOCOL_ERROR)),
    # 8.5 CONNECT: :method and :authority only (answered 501: the proxy does not tunnel).
    "8.5/connect": ("", fields([(":method", "CONNECT"), (":authority", "a:443")]),
                    ("status", 1, 501)),
    "8.5/connect_with_path": ("", fields([(":method", "CONNECT"), (":authority", "a:443"),
                                          (":path", "/")]), RS(E.PROTOCOL_ERROR)),
    "8.5/connect_with_scheme": ("", fields([(":method", "CONNECT"), (":authority", "a:443"),
                                            (":scheme", "http")]), RS(E.PROTOCOL_ERROR)),
    "8.5/connect_without_authority": ("", fields([(":method", "CONNECT")]),
                                      RS(E.PROTOCOL_ERROR)),
    # 8.4 server push: a client cannot push.
    "8.4/push_promise": ("", lambda c: [H(c, 1, path="/delay/300"), raw_frame(
        PUSH, EH, 1, (2).to_bytes(4, "big") + blk(c))], GO(E.PROTOCOL_ERROR)),
    "8.4/push_promise_on_stream_0": ("", lambda c: [raw_frame(
        PUSH, EH, 0, (2).to_bytes(4, "big") + blk(c))], GO(E.PROTOCOL_ERROR)),
}


def _is_probe(f: Frame) -> bool:
    return isinstance(f, PingFrame) and "ACK" in f.flags and f.opaque_data == PROBE


@pytest.mark.parametrize("case", sorted(CASES))
def test_conformance(connect: Callable[[], FrameClient], case: str) -> None:
    mode, build, expect = CASES[case]
    with connect() as c:
        if mode != "raw":
            c.handshake()
        if mode in ("after1", "after5"):
            sid = int(mode[-1])
            c.send(c.request(sid))
            assert c.response(sid).status == 200
        c.send(*build(c))
        if mode not in ("open", "raw"):
            c.send(PingFrame(0, opaque_data=PROBE))
        kind = expect[0]
        if kind in ("goaway", "closed"):
            frames = c.frames_until(lambda f: isinstance(f, GoAwayFrame))
            goaway = [f for f in frames if isinstance(f, GoAwayFrame)]
            if kind == "goaway":
                assert goaway, f"no GOAWAY (eof={c.eof}): {frames}"
                assert goaway[0].error_code == expect[1], ErrorCodes(goaway[0].error_code)
            else:  # RFC 9113 3.4: GOAWAY may be left out for an invalid preface
                assert not goaway or goaway[0].error_code == E.PROTOCOL_ERROR, goaway
            assert not [f for f in frames if _is_probe(f)], "probe answered after the error"
            assert c.closed_after(3), "connection not closed"
            return
        if kind == "status":
            sid, status = expect[1:]
            resp = c.response(sid)
            assert resp.status == status and resp.reset is None, resp
            assert resp.goaway is None or resp.goaway.error_code == E.NO_ERROR, resp.goaway
            return
        # "reset" or "ignored": read up to the probe's ACK (and the reset, which may come
        # after it: a malformed request is seen once the whole read is parsed).
        want_reset = expect[1] if kind == "reset" else None
        seen: list[Frame] = []

        def done(f: Frame) -> bool:
            seen.append(f)
            if isinstance(f, GoAwayFrame):
                return True
            probed = any(_is_probe(x) for x in seen)
            reset = any(isinstance(x, RstStreamFrame) and x.stream_id == want_reset
                        for x in seen)
            return probed and (want_reset is None or reset)

        c.frames_until(done)
        assert not [f for f in seen if isinstance(f, GoAwayFrame)], seen
        assert any(_is_probe(f) for f in seen), f"no PING ACK (eof={c.eof}): {seen}"
        assert not [f for f in seen if isinstance(f, PingFrame) and f.opaque_data == ACKED], \
            "a PING ACK answered"
        resets = [(f.stream_id, f.error_code) for f in seen if isinstance(f, RstStreamFrame)]
        if kind == "reset":
            assert resets == [(want_reset, expect[2])], resets  # one, with its code
            c.send(c.request(101))  # the connection goes on
            assert c.response(101).status == 200
        else:
            assert resets == [], resets


def _take_data(c: FrameClient, sid: int, n: int) -> list[int]:
    """Reads DATA on sid until n bytes (or END_STREAM) arrived, then a PING round trip:
    the sizes of the DATA frames read, those behind the first n bytes included."""
    sizes: list[int] = []

    def enough(f: Frame) -> bool:
        if isinstance(f, DataFrame) and f.stream_id == sid:
            sizes.append(len(f.data))
            return sum(sizes) >= n or "END_STREAM" in f.flags
        return False

    if n:
        c.frames_until(enough)
    c.send(PingFrame(0, opaque_data=PROBE))
    for f in c.frames_until(_is_probe):
        if isinstance(f, DataFrame) and f.stream_id == sid and f.data:
            sizes.append(len(f.data))
    return sizes


@pytest.mark.parametrize("case", ["initial_window_1", "raised_after_headers",
                                  "negative_window", "last_value_wins"])
def test_flow_control_settings(connect: Callable[[], FrameClient], case: str) -> None:
    """RFC 9113 6.5.3, 6.9.1, 6.9.2: SETTINGS_INITIAL_WINDOW_SIZE bounds the DATA the
    server sends on a stream (the last value of a SETTINGS frame counts), a change
    applies to open streams, and may make a window negative."""
    with connect() as c:
        first = {"initial_window_1": {4: 1}, "raised_after_headers": {4: 0},
                 "negative_window": {4: 5}, "last_value_wins": {}}[case]
        c.handshake(first)
        if case == "last_value_wins":
            c.send(raw_frame(SETTINGS, 0, 0, S((4, 100), (4, 1))))
        c.send(H(c, 1, path="/bytes/100"))
        c.frames_until(lambda f: f.type == HEADERS and f.stream_id == 1)
        got = 0
        if case == "raised_after_headers":
            assert _take_data(c, 1, 0) == []
            c.send(raw_frame(SETTINGS, 0, 0, S((4, 10))))
            assert _take_data(c, 1, 10) == [10]
            got = 10
        elif case == "negative_window":
            assert _take_data(c, 1, 5) == [5]
            c.send(raw_frame(SETTINGS, 0, 0, S((4, 2))), wu(1, 3))  # window -3, then 0
            assert _take_data(c, 1, 0) == []
            c.send(wu(1, 1))
            assert _take_data(c, 1, 1) == [1]
            got = 6
        else:
            assert _take_data(c, 1, 1) == [1]
            got = 1
        c.send(wu(1, 1000))
        assert sum(_take_data(c, 1, 100 - got)) == 100 - got


@pytest.mark.parametrize("max_frame", [16384, 20000])
def test_data_frames_within_the_clients_max_frame_size(connect: Callable[[], FrameClient],
                                                       max_frame: int) -> None:
    """RFC 9113 4.2: no frame larger than the client's SETTINGS_MAX_FRAME_SIZE."""
    with connect() as c:
        c.handshake({5: max_frame} if max_frame != 16384 else {})
        c.send(H(c, 1, path="/bytes/60000"))  # within the default 65535 windows
        frames = c.frames_until(lambda f: f.stream_id == 1 and "END_STREAM" in f.flags)
        sizes = [len(f.data) for f in frames if isinstance(f, DataFrame)]
        assert sum(sizes) == 60000 and max(sizes) == max_frame, sizes


def test_tls_listener_speaks_h2_after_alpn(proxy: ProxyProc) -> None:
    """RFC 9113 3.2: h2 is chosen with ALPN; the server's first frame is SETTINGS."""
    with FrameClient(proxy.ports["tls"], tls=client_tls()) as c:
        assert c.sock.selected_alpn_protocol() == "h2"
        c.handshake()
        first = c.recv()
        assert first is not None and first.type == SETTINGS and "ACK" not in first.flags


def test_client_goaway_is_answered_before_close(connect: Callable[[], FrameClient]) -> None:
    """RFC 9113 6.8: an endpoint SHOULD send GOAWAY before it closes; what the client's
    last frames asked for (a PING's ACK here) goes out first."""
    with connect() as c:
        c.handshake()
        c.send(raw_frame(GOAWAY, 0, 0, bytes(8)), PingFrame(0, opaque_data=PROBE))
        frames = c.frames_until(lambda f: isinstance(f, GoAwayFrame))
        assert any(_is_probe(f) for f in frames), frames
        assert frames and isinstance(frames[-1], GoAwayFrame), frames
        assert frames[-1].error_code == E.NO_ERROR
        assert c.closed_after(3)


def test_header_table_size_stated_twice_still_gets_its_update(
        connect: Callable[[], FrameClient]) -> None:
    """RFC 7541 4.2: after SETTINGS_HEADER_TABLE_SIZE shrinks the table, the next header
    block starts with a dynamic table size update. A client that stated the same size
    twice (as an h2c upgrade client does: HTTP2-Settings, then its preface SETTINGS) got
    none, and `nghttp -u -c 0` failed with COMPRESSION_ERROR."""
    with connect() as c:
        c.handshake({SettingsFrame.HEADER_TABLE_SIZE: 0})
        c.send(SettingsFrame(0, settings={SettingsFrame.HEADER_TABLE_SIZE: 0}),
               c.request(1, "/echo"))
        frames = c.frames_until(lambda f: isinstance(f, HeadersFrame))
    assert frames and isinstance(frames[-1], HeadersFrame), frames
    assert frames[-1].data[:1] == b"\x20", frames[-1].data[:8]  # size update to 0
