"""aiproxy/protocols/h2_fast.py against the libraries it stands in for: its HPACK output
decoded by hpack's own Decoder, FastDecoder beside hpack's Decoder on the same blocks
(valid and broken), and checked_fields() beside h2's normalize+validate pipeline on a
generated corpus of field blocks, valid and malformed (RFC 9113 8.2, 8.3)."""

from __future__ import annotations

import random

import h2.utilities
import hpack
import pytest
from h2.exceptions import ProtocolError
from h2.utilities import HeaderValidationFlags
from hyperframe.frame import DataFrame, Frame

from aiproxy.protocols import h2_fast

FIELDS = [
    (b":status", b"200"), (b":status", b"404"), (b":status", b"299"),
    (b":method", b"GET"), (b":path", b"/"), (b":path", b"/v1/chat/completions?x=1"),
    (b"content-type", b"application/grpc"), (b"content-length", b"2"),
    (b"server", b"nginx/1.22.1"), (b"date", b"Mon, 30 Nov 2026 00:00:00 GMT"),
    (b"x-custom", b"value"), (b"x-long", b"v" * 300), (b"n" * 200, b"short"),
    (b"x-binary", bytes(range(0x21, 0x7f)) + bytes(range(0x80, 0x100))),
    (b"authorization", b"Bearer secret"), (b"cookie", b"a=b"), (b"set-cookie", b"c=d"),
    (b"proxy-authorization", b"Basic eDp5"), (b"x-api-key", b"sk-ant-1"),
    (b"api-key", b"azure-1"), (b"x-goog-api-key", b"AIza1"), (b"x-auth-token", b"t1"),
    (b"grpc-status", b"0"), (b"grpc-message", b""), (b"te", b"trailers"),
]


def test_encoded_fields_decode_to_the_same_list_and_leave_the_table_empty() -> None:
    dec = hpack.Decoder()
    rng = random.Random(7)
    for _ in range(300):
        fields = rng.sample(FIELDS, rng.randint(1, len(FIELDS)))
        out = dec.decode(h2_fast.encode_fields(fields), raw=True)
        assert [tuple(f) for f in out] == fields
        assert len(dec.header_table.dynamic_entries) == 0
        for got, (name, _value) in zip(out, fields, strict=True):
            # RFC 7541 7.1.3: credentials (an upstream API key as much as
            # Authorization) and cookies go out never-indexed.
            secret = name in (b"authorization", b"proxy-authorization", b"cookie",
                              b"set-cookie", b"x-api-key", b"api-key", b"x-goog-api-key",
                              b"x-auth-token")
            assert isinstance(got, hpack.NeverIndexedHeaderTuple) == secret


def test_fast_blocks_mix_with_hpack_encoder_blocks() -> None:
    """After the peer resizes its table, h2's own encoder writes the next block (it must
    start with a size update); our blocks before and after stay decodable."""
    enc, dec = hpack.Encoder(), hpack.Decoder()
    first = [(b":status", b"200"), (b"x-a", b"1")]
    assert dec.decode(enc.encode(first), raw=True) == first  # indexes x-a
    assert dec.decode(h2_fast.encode_fields(first), raw=True) == first
    enc.header_table_size = 0
    assert enc.header_table.resized
    assert dec.decode(enc.encode(first), raw=True) == first
    assert dec.header_table_size == 0
    assert dec.decode(h2_fast.encode_fields(first), raw=True) == first


def _blocks(rng: random.Random) -> list[bytes]:
    enc = hpack.Encoder()
    blocks = []
    for _ in range(200):
        fields = rng.sample(FIELDS, rng.randint(1, 8))
        fields = [f for f in fields if f[0] not in (b"authorization", b"cookie")]
        blocks.append(enc.encode(fields or [(b":path", b"/")], huffman=rng.random() < 0.5))
    return blocks


def _outcome(dec: hpack.Decoder, block: bytes) -> object:
    try:
        return [tuple(f) for f in dec.decode(block, raw=True)], list(
            dec.header_table.dynamic_entries)
    except hpack.HPACKError as exc:
        return type(exc)


def test_fast_decoder_matches_hpack_decoder() -> None:
    rng = random.Random(11)
    blocks = _blocks(rng)
    ref, fast = hpack.Decoder(), h2_fast.FastDecoder()
    for block in blocks:
        assert _outcome(fast, block) == _outcome(ref, block)
    # Broken blocks: bad indexes (0, past the dynamic table, multi-byte past it), size
    # updates after a field, truncation, and mutations of valid blocks.
    broken = [b"\x80", b"\xbf", b"\xff\x10", b"\x82\x3f\xe1\x1f", b"\x82\x20",
              b"\x40\x05ab", b"\x00\x81", b"\x0f\x2f"]
    for block in blocks[:60]:
        data = bytearray(block)
        data[rng.randrange(len(data))] = rng.randrange(256)
        broken.append(bytes(data))
        broken.append(block[:-1])
    for block in broken:
        ref_dec, fast_dec = hpack.Decoder(), h2_fast.FastDecoder()
        for b in blocks[:5]:  # some dynamic entries first
            ref_dec.decode(b, raw=True)
            fast_dec.decode(b, raw=True)
        assert _outcome(fast_dec, block) == _outcome(ref_dec, block), block


def test_fast_decoder_header_list_limit() -> None:
    block = hpack.Encoder().encode([(b"x-big", b"v" * 200)] * 5)
    for dec in (hpack.Decoder(max_header_list_size=500),
                h2_fast.FastDecoder(max_header_list_size=500)):
        with pytest.raises(hpack.OversizedHeaderListError):
            dec.decode(block, raw=True)


# -- checked_fields beside h2's pipeline --------------------------------------------------

PIECES = [
    (b":method", b"GET"), (b":method", b"POST"), (b":method", b"CONNECT"),
    (b":scheme", b"https"), (b":path", b"/"), (b":path", b""), (b":authority", b"a.test"),
    (b":authority", b"b.test"), (b":status", b"200"), (b":protocol", b"websocket"),
    (b":custom", b"x"), (b":PATH", b"/"), (b"host", b"a.test"), (b"host", b"b.test"),
    (b"content-type", b"text/plain"), (b"te", b"trailers"), (b"te", b"TRAILERS"),
    (b"te", b"gzip"), (b"connection", b"close"), (b"keep-alive", b"1"),
    (b"transfer-encoding", b"chunked"), (b"upgrade", b"h2c"), (b"proxy-connection", b"x"),
    (b"cookie", b"a=1"), (b"cookie", b"b=2"), (b"cookie", b" c=3"), (b"cookie", b""),
    (b"x-ok", b"v"), (b"x-ok", b""), (b"X-Upper", b"v"), (b"", b"v"), (b"x sp", b"v"),
    (b"x:colon", b"v"), (b"x-nul", b"a\x00b"), (b"x-cr", b"a\rb"), (b"x-lf", b"a\nb"),
    (b"x-lead", b" v"), (b"x-trail", b"v\t"), (b"x-del", b"\x7fv"), (b"x\x80", b"v"),
    (b"x-high", b"\xffv"), (b"grpc-status", b"0"),
]
REQUEST_BASE = [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/"),
                (b":authority", b"a.test")]
RESPONSE_BASE = [(b":status", b"200")]


def _h2_pipeline(headers: list, flags: HeaderValidationFlags) -> object:
    try:
        out = h2.utilities.validate_headers(
            h2.utilities.normalize_inbound_headers(headers, flags), flags)
        return [tuple(f) for f in out]
    except ProtocolError:
        return ProtocolError


def _ours(headers: list, flags: HeaderValidationFlags) -> object:
    try:
        return [tuple(f) for f in h2_fast.checked_fields(headers, flags)]
    except ProtocolError:
        return ProtocolError


@pytest.mark.parametrize("kind", ["request", "response", "trailers"])
def test_checked_fields_agree_with_h2(kind: str) -> None:
    rng = random.Random(hash(kind) & 0xFFFF)
    flags = HeaderValidationFlags(is_client=kind == "response", is_trailer=kind == "trailers",
                                  is_response_header=kind == "response",
                                  is_push_promise=False)
    base = {"request": REQUEST_BASE, "response": RESPONSE_BASE, "trailers": []}[kind]
    seen = {ProtocolError: 0, list: 0}
    for _ in range(4000):
        headers = list(base)
        for _ in range(rng.randint(0, 4)):
            headers.insert(rng.randint(0, len(headers)), rng.choice(PIECES))
        if headers and rng.random() < 0.2:
            del headers[rng.randrange(len(headers))]
        expected = _h2_pipeline(list(headers), flags)
        assert _ours(list(headers), flags) == expected, headers
        seen[ProtocolError if expected is ProtocolError else list] += 1
    assert seen[ProtocolError] > 100 and seen[list] > 100, seen


def test_grpc_timeout_value_round_trips() -> None:
    from aiproxy.pipeline.exchange import grpc_timeout, grpc_timeout_value

    for seconds, text in [(4.4567, b"4456m"), (0.0001, b"1m"), (-1.0, b"1m"),
                          (99_999.999, b"99999999m"), (100_000.0, b"100000S"),
                          (10**12, b"99999999S")]:
        value = grpc_timeout_value(seconds)
        assert value == text and len(value) <= 9
        assert grpc_timeout(value) is not None


def test_frame_flags_still_checked() -> None:
    from hyperframe.frame import DataFrame, HeadersFrame

    a, b = HeadersFrame(1), HeadersFrame(3)
    a.flags.add("END_STREAM")
    assert "END_STREAM" in a.flags and "END_STREAM" not in b.flags
    with pytest.raises(ValueError):
        DataFrame(1).flags.add("END_HEADERS")


def test_plain_frames_are_built_as_hyperframe_parses_them() -> None:
    """h2_fast.plain_frame against hyperframe's own parser on 20,000 generated HEADERS
    and DATA frames (every flag byte, stream ids with the reserved bit, stream 0): the
    same attributes, or None where hyperframe's path must decide (padding, priority,
    no END_HEADERS, stream 0)."""
    import hyperframe.frame

    rng = random.Random(7)
    built = 0
    for _ in range(20_000):
        kind = rng.choice((0, 1))
        flags = rng.randrange(256)
        sid = rng.choice((0, 1, 3, 0x7FFFFFFF, rng.randrange(1 << 32)))
        body = rng.randbytes(rng.choice((0, 1, 5, 40)))
        data = bytearray(len(body).to_bytes(3, "big") + bytes((kind, flags))
                         + sid.to_bytes(4, "big") + body)
        fast = h2_fast.plain_frame(data, len(body))
        if fast is None:
            assert (sid & 0x7FFFFFFF == 0 or (kind == 1 and flags & 0x2C != 0x04)
                    or (kind == 0 and flags & 0x08))
            continue
        slow, length = hyperframe.frame.Frame.parse_frame_header(memoryview(data[:9]))
        slow.parse_body(memoryview(data[9:9 + length]))
        assert type(fast) is type(slow)
        want, got = dict(vars(slow)), dict(vars(fast))
        assert set(got.pop("flags")) == set(want.pop("flags")), (kind, flags)
        assert got == want
        assert fast.flags._valid_flags == slow.flags._valid_flags
        built += 1
    assert built > 4_000


# -- GOAWAY and frames not yet written ----------------------------------------------------


def test_goaway_keeps_frames_queued_for_streams_in_flight() -> None:
    """RFC 9113 6.8: after a peer's GOAWAY the streams it named as processed carry on.
    Frames already queued for them (DATA, END_STREAM) but not yet taken by
    data_to_send() stay queued: h2 itself empties its send buffer on a GOAWAY, which
    silently lost request DATA to a gracefully stopping upstream (client side) and
    response DATA to a client going away (server side)."""
    import h2.config
    import h2.connection

    from aiproxy.protocols.h2_server import _ServerH2
    from aiproxy.protocols.h2_upstream import _ClientH2

    request = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/s/M"),
               (b":authority", b"a.test")]
    for ours_is_client in (True, False):
        ours = (_ClientH2 if ours_is_client else _ServerH2)(h2.config.H2Configuration(
            client_side=ours_is_client, header_encoding=None))
        peer = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=not ours_is_client, header_encoding=None))
        client, server = (ours, peer) if ours_is_client else (peer, ours)
        client.initiate_connection()
        server.initiate_connection()
        server.receive_data(client.data_to_send())
        client.receive_data(server.data_to_send())
        server.receive_data(client.data_to_send())
        client.send_headers(1, request)
        server.receive_data(client.data_to_send())
        if not ours_is_client:
            server.send_headers(1, [(b":status", b"200")])
        ours.send_data(1, b"queued before the GOAWAY", end_stream=True)
        peer.close_connection(last_stream_id=1)
        ours.receive_data(peer.data_to_send())
        # Read as frames: h2 (the peer here) takes no frame once it has sent GOAWAY.
        frames = _read_frames(ours.data_to_send())
        data = [f for f in frames if isinstance(f, DataFrame)]
        assert [(f.stream_id, f.data, "END_STREAM" in f.flags) for f in data] == \
            [(1, b"queued before the GOAWAY", True)], (ours_is_client, frames)


# -- DATA over content-length and the connection window -----------------------------------


def _read_frames(out: bytes) -> list[Frame]:
    frames = []
    while out:
        frame, length = Frame.parse_frame_header(memoryview(out[:9]))
        frame.parse_body(memoryview(out[9:9 + length]))
        frames.append(frame)
        out = out[9 + length:]
    return frames


@pytest.mark.parametrize("ours_is_client", [False, True], ids=["server", "upstream"])
def test_data_over_content_length_is_given_back_to_the_connection_window_once(
        ours_is_client: bool) -> None:
    """DATA past a content-length makes its stream malformed (RFC 9113 8.1.1); h2 has
    counted it against the connection window, and the proxy gives it back. It did
    that through process_bytes(), which already adds what it returns to h2's inbound
    window, and then increment_flow_control_window(), which adds it again: h2 then
    took that much more from the peer than its WINDOW_UPDATEs had granted. Now the
    window h2 enforces is the one it advertised: one byte past it is a FLOW_CONTROL_ERROR
    (RFC 9113 6.9.1)."""
    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions
    from hyperframe.frame import HeadersFrame, SettingsFrame

    from aiproxy.protocols.h2_server import _ServerH2
    from aiproxy.protocols.h2_upstream import _ClientH2

    ours = (_ClientH2 if ours_is_client else _ServerH2)(h2.config.H2Configuration(
        client_side=ours_is_client, header_encoding=None))
    ours.initiate_connection()
    sids = [1, 3, 5, 7]
    if ours_is_client:
        for sid in sids:
            ours.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"http"),
                                    (b":path", b"/"), (b":authority", b"a.test")],
                              end_stream=True)
        head = [(b":status", b"200")]
        peer = SettingsFrame(0).serialize()
    else:
        head = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/"),
                (b":authority", b"a.test")]
        peer = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0).serialize()
    peer += SettingsFrame(0, flags=["ACK"]).serialize()
    ours.receive_data(peer)
    ours.data_to_send()
    enc = hpack.Encoder()

    def headers(sid: int, fields: list[tuple[bytes, bytes]]) -> bytes:
        f = HeadersFrame(sid, flags=["END_HEADERS"])
        f.data = enc.encode(fields)
        return f.serialize()

    def data(sid: int, n: int) -> bytes:
        return DataFrame(sid, data=b"x" * n).serialize()

    window = ours.inbound_flow_control_window  # 65535: a stream's default too
    piece = 16384
    # Two streams whose single DATA frame is over their content-length of 0: half the
    # connection window, which h2 gives back at once.
    events = ours.receive_data(b"".join(
        headers(sid, [*head, (b"content-length", b"0")]) + data(sid, piece)
        for sid in sids[:2]))
    assert [e.stream_id for e in events if isinstance(e, h2.events.StreamReset)] == sids[:2]
    updates = [f.window_increment for f in _read_frames(ours.data_to_send())
               if f.type == 0x8 and f.stream_id == 0]
    assert updates == [2 * piece]
    granted = window - 2 * piece + sum(updates)
    # Two streams whose DATA, never acknowledged here, fills exactly what was granted.
    ours.receive_data(headers(sids[2], head) + headers(sids[3], head))
    full, rest = divmod(granted, piece)
    frames = [data(sids[2 + i % 2], piece) for i in range(full)]
    frames.append(data(sids[3], rest))
    ours.receive_data(b"".join(frames))
    assert ours.inbound_flow_control_window == 0
    with pytest.raises(h2.exceptions.FlowControlError):
        ours.receive_data(data(sids[2], 1))
