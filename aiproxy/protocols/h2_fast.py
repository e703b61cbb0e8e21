"""The proxy's own outbound HEADERS and DATA frames on a connection the h2 library runs.

h2's send path costs most of an HTTP/2 request's CPU in Python: per header field it
searches the HPACK tables, Huffman-codes, builds hyperframe objects and serializes them.
The proxy builds every field list it sends itself (names already lower-case, hop fields
dropped), so outbound validation is off anyway; what is left to do is the stream state
transition (kept: h2's state machines still decide what may be sent) and the bytes.

HPACK here is stateless, as in nginx: fields go out as static-table indexes or literals
*without indexing*, so an encoding depends only on the field and is cached. The peer's
dynamic table then only changes when h2's own encoder writes a block (the connection
preface, or the first block after the peer resized the table: that block must start with
a table size update, RFC 7541 4.2), and since these blocks never refer to it, both
encoders' blocks stay valid. Credentials go out never-indexed (RFC 7541 7.1.3) and are
not cached.
"""

from __future__ import annotations

import logging
from typing import Any

import h2.connection
import h2.events
import h2.exceptions
import h2.frame_buffer
import h2.stream
import h2.utilities
import hpack.hpack
import hyperframe.flags
import hyperframe.frame
from h2.connection import AllowedStreamIDs, ConnectionInputs
from h2.errors import ErrorCodes
from h2.exceptions import ProtocolError
from h2.stream import StreamInputs
from hpack import NeverIndexedHeaderTuple
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.table import HeaderTable
from hyperframe.exceptions import InvalidPaddingError
from hyperframe.frame import ExtensionFrame, RstStreamFrame, WindowUpdateFrame

from aiproxy.protocols.fields import CREDENTIAL_FIELDS, same_authority

T_DATA = 0x0
T_HEADERS = 0x1
T_CONTINUATION = 0x9
END_STREAM = 0x1
END_HEADERS = 0x4
# Frames h2 parses and dispatches in one receive_data call (_FrameBuffer): between
# passes the caller settles its budgets, so a flood is cut within a pass of its limit.
FRAMES_PER_PASS = 64
PREFACE_LENGTH = 24  # b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# hyperframe builds, for every frame it parses, the set of its class's flag names: made
# once per frame class here instead (same set, read-only; other callers unchanged).
_FLAG_NAMES = {id(cls.defined_flags): (cls.defined_flags,
                                       frozenset(f.name for f in cls.defined_flags))
               for cls in hyperframe.frame.FRAMES.values()}


def _flags_init(self: hyperframe.flags.Flags, defined_flags: Any) -> None:
    entry = _FLAG_NAMES.get(id(defined_flags))
    if entry is not None and entry[0] is defined_flags:
        self._valid_flags = entry[1]
    else:
        self._valid_flags = {flag.name for flag in defined_flags}
    self._flags = set()


hyperframe.flags.Flags.__init__ = _flags_init


def _headers_parse_body(self: hyperframe.frame.HeadersFrame, data: memoryview) -> None:
    """hyperframe's HeadersFrame.parse_body with RFC 9113 6.2's padding rule: padding
    may take all of the field block fragment (an empty one, the block in CONTINUATION)
    but not more. hyperframe compared it with the payload, the priority fields
    included: it refused an empty fragment and let padding run over the priority."""
    data = data[self.parse_padding_data(data):]
    prio = self.parse_priority_data(data) if "PRIORITY" in self.flags else 0
    self.body_len = len(data)
    if self.pad_length > self.body_len - prio:
        raise InvalidPaddingError("Padding is too long.")
    self.data = data[prio:self.body_len - self.pad_length].tobytes()


hyperframe.frame.HeadersFrame.parse_body = _headers_parse_body

_huffman = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)
_STATIC: dict[tuple[bytes, bytes], int] = {}
_STATIC_NAMES: dict[bytes, int] = {}
for _i, _field in enumerate(HeaderTable.STATIC_TABLE, 1):
    _STATIC.setdefault(_field, _i)
    _STATIC_NAMES.setdefault(_field[0], _i)
_SECRET = CREDENTIAL_FIELDS
_CACHE: dict[tuple[bytes, bytes], bytes] = {}
CACHE_LIMIT = 4096


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(s: bytes) -> bytes:
    h = _huffman.encode(s)
    if len(h) < len(s):
        return _integer(len(h), 7, 0x80) + h
    return _integer(len(s), 7, 0) + s


def _encode_field(name: bytes, value: bytes) -> bytes:
    if name in _SECRET:
        first = 0x10  # never indexed
    else:
        index = _STATIC.get((name, value))
        if index is not None:
            return bytes((0x80 | index,))
        first = 0x00  # without indexing
    index = _STATIC_NAMES.get(name)
    if index is not None:
        return _integer(index, 4, first) + _string(value)
    return bytes((first,)) + _string(name) + _string(value)


def encode_fields(fields: list[tuple[bytes, bytes]]) -> bytes:
    """One HPACK field block, touching no dynamic table."""
    cache = _CACHE
    out = []
    for field in fields:
        block = cache.get(field)
        if block is None:
            name, value = field
            block = _encode_field(name, value)
            if name not in _SECRET:
                if len(cache) >= CACHE_LIMIT:
                    cache.clear()
                cache[field] = block
        out.append(block)
    return b"".join(out)


def _frame_head(length: int, kind: int, flags: int, sid: int) -> bytes:
    return (length.to_bytes(3, "big") + bytes((kind, flags)) + sid.to_bytes(4, "big"))


def send_headers(conn: Any, sid: int, fields: list[tuple[bytes, bytes]],
                 end_stream: bool = False, method: bytes | None = None) -> None:
    """h2's send_headers for a field list the proxy built: a response (or informational
    response, or trailers) on a server connection, a request or trailers on a client one
    (method given for a new request: h2 needs it to frame a HEAD response).
    Raises what h2 would (ProtocolError, StreamClosedError) when the state forbids it."""
    conn.state_machine.process_input(ConnectionInputs.SEND_HEADERS)
    stream = conn.streams.get(sid)
    if stream is None:
        # h2 would count the open streams here (a scan of all of them, which is also when
        # it forgets closed ones): the caller keeps to the peer's limit, and sweeps.
        stream = conn._get_or_create_stream(sid, AllowedStreamIDs(conn.config.client_side))
    if (not conn.config.client_side and fields[0][0] == b":status"
            and fields[0][1][:1] == b"1"):
        if end_stream:
            raise ProtocolError("informational responses cannot end the stream")
        stream.state_machine.process_input(StreamInputs.SEND_INFORMATIONAL_HEADERS)
    else:
        stream.state_machine.process_input(StreamInputs.SEND_HEADERS)
    encoder = conn.encoder
    if encoder.table_size_changes:
        # A table size update is owed (RFC 7541 4.2). hpack's `resized` is not the test:
        # the same size set twice clears it (an h2c upgrade client's HTTP2-Settings,
        # then its preface SETTINGS), though the update has not gone out yet.
        encoder.header_table.resized = True
        block = encoder.encode(fields)  # starts with the table size update
    else:
        block = encode_fields(fields)
    if end_stream:
        stream.state_machine.process_input(StreamInputs.SEND_END_STREAM)
    if method is not None:
        stream.request_method = method
    max_frame = conn.max_outbound_frame_size
    n = len(block)
    flags = END_STREAM if end_stream else 0
    out = conn._data_to_send
    if n <= max_frame:
        out += _frame_head(n, T_HEADERS, flags | END_HEADERS, sid)
        out += block
        return
    out += _frame_head(max_frame, T_HEADERS, flags, sid)
    out += block[:max_frame]
    off = max_frame
    while off < n:
        size = min(n - off, max_frame)
        out += _frame_head(size, T_CONTINUATION, END_HEADERS if off + size == n else 0, sid)
        out += block[off:off + size]
        off += size


def send_data(conn: Any, stream: Any, data: bytes | memoryview, end_stream: bool = False) -> None:
    """h2's send_data without its checks: the caller keeps data within the flow-control
    window (min of the connection's and the stream's) and the peer's frame size."""
    n = len(data)
    conn.state_machine.process_input(ConnectionInputs.SEND_DATA)
    sm = stream.state_machine
    sm.process_input(StreamInputs.SEND_DATA)
    if end_stream:
        sm.process_input(StreamInputs.SEND_END_STREAM)
    stream.outbound_flow_control_window -= n
    conn.outbound_flow_control_window -= n
    conn.data_frames_sent += 1
    out = conn._data_to_send
    out += _frame_head(n, T_DATA, END_STREAM if end_stream else 0, stream.stream_id)
    out += data


def end_stream(conn: Any, sid: int) -> None:
    """An empty DATA frame with END_STREAM."""
    stream = conn._get_stream_by_id(sid)
    conn.state_machine.process_input(ConnectionInputs.SEND_DATA)
    stream.state_machine.process_input(StreamInputs.SEND_END_STREAM)
    conn._data_to_send += _frame_head(0, T_DATA, END_STREAM, sid)


def stream_window(conn: Any, sid: int) -> tuple[Any, int]:
    """h2's stream and how many DATA bytes may go out on it now (h2's
    local_flow_control_window; raises StreamClosedError/NoSuchStreamError as it does)."""
    stream = conn.streams.get(sid)
    if stream is None:
        stream = conn._get_stream_by_id(sid)
    w = stream.outbound_flow_control_window
    c = conn.outbound_flow_control_window
    return stream, (w if w < c else c)


class _Quiet:
    """Stands in for hpack's module logger while it is not enabled for DEBUG: hpack calls
    log.debug for every header field it decodes, which costs even when nothing logs."""

    def __init__(self, real: logging.Logger) -> None:
        self.real = real

    def debug(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def quiet_hpack_logging() -> None:
    log = hpack.hpack.log
    if isinstance(log, _Quiet):
        if log.real.isEnabledFor(logging.DEBUG):
            hpack.hpack.log = log.real
    elif not log.isEnabledFor(logging.DEBUG):
        hpack.hpack.log = _Quiet(log)


# -- inbound: h2's header validation in one pass ---------------------------------------

_NAME_CHARS = bytes(range(0x21, 0x41)) + bytes(range(0x5B, 0x7F))  # RFC 9113 8.2.1
_CONNECTION_FIELDS = h2.utilities.CONNECTION_HEADERS
_PSEUDO_FIELDS = h2.utilities._ALLOWED_PSEUDO_HEADER_FIELDS


def _check_value(value: bytes) -> None:
    if len(value.translate(None, b"\0\r\n")) != len(value):
        raise ProtocolError(f"Illegal character in header value: {value!r}")
    if value[0] in (0x20, 0x09) or value[-1] in (0x20, 0x09):
        raise ProtocolError(f"Received header value surrounded by whitespace {value!r}")


def checked_fields(headers: list, flags: Any) -> list:
    """h2's normalize_inbound_headers + validate_headers (RFC 9113 8.2 and 8.3, as h2 4.x
    applies them, with the same outcome for every input) as one loop with C-speed
    character checks instead of a chain of seven generators."""
    out = []
    cookies = None
    pseudo: set[bytes] = set()
    regular = False
    method = None
    request = not flags.is_response_header and not flags.is_trailer
    authority = host = scheme = None
    for field in headers:
        name, value = field
        if name == b"cookie":
            # Joined and put last, as h2's normalization does, then checked.
            if cookies is None:
                cookies = []
            cookies.append(value)
            continue
        if not name:
            raise ProtocolError("Received header name with zero length.")
        if name.translate(None, _NAME_CHARS) or name.find(b":", 1) != -1:
            raise ProtocolError(f"Illegal character in header name: {name!r}")
        if value:
            _check_value(value)
        if name[0] == 0x3A:
            if name in pseudo:
                raise ProtocolError(f"Received duplicate pseudo-header field {name!r}")
            pseudo.add(name)
            if regular:
                raise ProtocolError(f"Received pseudo-header field out of sequence: {name!r}")
            if name not in _PSEUDO_FIELDS:
                raise ProtocolError(f"Received custom pseudo-header field {name!r}")
            if name == b":method":
                method = value
            elif request:
                if name == b":authority":
                    authority = value
                elif name == b":scheme":
                    scheme = value
                elif name == b":path" and not value:
                    raise ProtocolError("An empty :path header is forbidden")
        else:
            if name == b"te" and value.lower() != b"trailers":
                raise ProtocolError(f"Invalid value for TE header: {value!r}")
            if name in _CONNECTION_FIELDS:
                raise ProtocolError(f"Connection-specific header field present: {name!r}.")
            regular = True
            if request and name == b"host":
                if host is not None:
                    raise ProtocolError("Request header block has multiple Host headers.")
                host = value
        out.append(field)
    if cookies is not None:
        value = b"; ".join(cookies)
        if value:
            _check_value(value)
        out.append(NeverIndexedHeaderTuple(b"cookie", value))
    h2.utilities._check_pseudo_header_field_acceptability(pseudo, method, flags)
    if request:
        if authority is None and host is None:
            raise ProtocolError(
                "Request header block does not have an :authority or Host header.")
        if (authority is not None and host is not None
                and not same_authority(authority, host, scheme)):
            raise ProtocolError("Request header block has mismatched :authority and Host "
                                f"headers: {authority!r} / {host!r}")
    return out


# Fields kept from a header list past max_header_list_size: what a reply to it needs.
KEPT_OVER_LIMIT = frozenset((b"host", b"content-type"))


class FastDecoder(hpack.Decoder):
    """hpack's Decoder with the common case inline: a field from the static or dynamic
    table by a one-byte index (what a client repeating its fields sends). Every other
    representation, and every check (list size, table size, truncation, bad index),
    stays hpack's. Fields come back as hpack's tuples, or plain (name, value) tuples.

    With `hard_limit` set (a server's decoder), a list over max_header_list_size but
    within hard_limit is decoded to its end, so the dynamic table stays in step with the
    peer's encoder, and returned without its fields past the limit (pseudo-fields and
    KEPT_OVER_LIMIT aside), with `oversized` set: the stream can be answered 431 and
    the connection go on (RFC 9113 10.5.1). Past hard_limit, or a block itself longer
    than that (an HPACK bomb, a block far beyond any limit), it stays an
    OversizedHeaderListError, which h2 makes a connection error (ENHANCE_YOUR_CALM)."""

    hard_limit = 0
    oversized = False  # of the last block decoded

    def decode(self, data: bytes, raw: bool = False) -> list:
        if not raw:
            return list(super().decode(data, raw))
        self.oversized = False
        hard = self.hard_limit
        if hard and len(data) > hard:
            raise hpack.OversizedHeaderListError(
                f"A header block of {len(data)} bytes has been received")
        table = self.header_table
        static = HeaderTable.STATIC_TABLE
        n_static = len(static)
        dynamic = table.dynamic_entries
        mem = memoryview(data)
        headers: list = []
        size = 0
        limit = self.max_header_list_size
        i = 0
        n = len(data)
        while i < n:
            b = data[i]
            if b & 0x80:
                index = b & 0x7F
                if 0 < index <= n_static:
                    header = static[index - 1]
                    consumed = 1
                elif n_static < index < 0x7F and index - n_static <= len(dynamic):
                    header = dynamic[index - n_static - 1]
                    consumed = 1
                else:
                    header, consumed = self._decode_indexed(mem[i:])
            elif b & 0x40:
                header, consumed = self._decode_literal_index(mem[i:])
            elif b & 0x20:
                if headers:
                    raise hpack.HPACKDecodingError(
                        "Table size update not at the start of the block")
                consumed = self._update_encoding_context(mem[i:])
                header = None
            else:
                header, consumed = self._decode_literal_no_index(mem[i:])
            if header is not None:
                size += 32 + len(header[0]) + len(header[1])
                if size <= limit:
                    headers.append(header)
                elif size <= hard:
                    self.oversized = True
                    name = header[0]
                    if name[:1] == b":" or name in KEPT_OVER_LIMIT:
                        headers.append(header)
                else:
                    raise hpack.OversizedHeaderListError(
                        f"A header list larger than {max(limit, hard)} has been received")
            i += consumed
        self._assert_valid_table_size()
        return headers


class _Stream(h2.stream.H2Stream):
    """h2's stream with checked_fields() for received field blocks."""

    def _process_received_headers(self, headers: Any, flags: Any, header_encoding: Any) -> list:
        config = self.config
        if (header_encoding or not config.normalize_inbound_headers
                or not config.validate_inbound_headers):
            return super()._process_received_headers(headers, flags, header_encoding)
        return checked_fields(headers, flags)


class MalformedStream(h2.events.Event):
    """A new stream reset with PROTOCOL_ERROR for its malformed field block (RFC 9113
    8.1.1) before the caller heard of it."""

    def __init__(self, stream_id: int, reason: str) -> None:
        self.stream_id = stream_id
        self.reason = reason


# A frame h2 would take as a connection error where RFC 9113 asks for a stream error is
# rewritten, in the buffer, into an extension frame of this type carrying the error code;
# FastReceive._receive_frame resets its stream. Only as many as the buffer rewrote count.
STREAM_ERROR_FRAME = 0xF0


def _stream_error_code(kind: int, sid: int, payload: bytes | bytearray) -> int:
    """The stream error a whole frame on stream `sid` is, or 0:
    - RFC 9113 6.9: WINDOW_UPDATE with an increment of 0, PROTOCOL_ERROR;
    - 6.3: PRIORITY of a length other than 5, FRAME_SIZE_ERROR;
    - 5.3.1: PRIORITY making a stream depend on itself, PROTOCOL_ERROR."""
    if kind == 0x8:
        if len(payload) == 4 and not int.from_bytes(payload, "big") & 0x7FFFFFFF:
            return ErrorCodes.PROTOCOL_ERROR
    elif kind == 0x2:
        if len(payload) != 5:
            return ErrorCodes.FRAME_SIZE_ERROR
        if int.from_bytes(payload[0:4], "big") & 0x7FFFFFFF == sid:
            return ErrorCodes.PROTOCOL_ERROR
    return 0


def _flag_sets(cls: type) -> list[frozenset[str]]:
    """The names hyperframe sets for each value of a frame's flag byte (it ignores
    undefined bits)."""
    return [frozenset(f.name for f in cls.defined_flags if byte & f.bit) for byte in range(256)]


_HEADERS_FLAGS = _flag_sets(hyperframe.frame.HeadersFrame)
_DATA_FLAGS = _flag_sets(hyperframe.frame.DataFrame)
_HEADERS_VALID = _FLAG_NAMES[id(hyperframe.frame.HeadersFrame.defined_flags)][1]
_DATA_VALID = _FLAG_NAMES[id(hyperframe.frame.DataFrame.defined_flags)][1]
_Flags = hyperframe.flags.Flags
_HeadersFrame = hyperframe.frame.HeadersFrame
_DataFrame = hyperframe.frame.DataFrame


def _flags(valid: frozenset[str], names: frozenset[str]) -> Any:
    flags = _Flags.__new__(_Flags)
    flags._valid_flags = valid
    flags._flags = set(names)
    return flags


def plain_frame(data: bytearray, length: int) -> Any:
    """The frame at the start of data (its 9-byte header and `length` body bytes all
    there) when it is a HEADERS frame with END_HEADERS and neither padding nor priority,
    or an unpadded DATA frame, on a stream: what hyperframe would parse, built without
    its per-frame constructor chain and flag parsing. None for any other frame."""
    kind = data[3]
    flags = data[4]
    if kind > 1 or not (data[5] & 0x7F or data[6] or data[7] or data[8]):
        return None
    sid = int.from_bytes(data[5:9], "big") & 0x7FFFFFFF
    if kind == 1:
        if flags & 0x2C != 0x04:  # END_HEADERS, not PADDED, not PRIORITY
            return None
        f = _HeadersFrame.__new__(_HeadersFrame)
        f.flags = _flags(_HEADERS_VALID, _HEADERS_FLAGS[flags])
        f.depends_on = 0
        f.stream_weight = 0
        f.exclusive = False
    else:
        if flags & 0x08:  # PADDED
            return None
        f = _DataFrame.__new__(_DataFrame)
        f.flags = _flags(_DATA_VALID, _DATA_FLAGS[flags])
    f.stream_id = sid
    f.body_len = length
    f.pad_length = 0
    f.data = bytes(data[9:9 + length])
    return f


class _FrameBuffer(h2.frame_buffer.FrameBuffer):
    """h2's FrameBuffer, checked on the frame header before h2 parses anything:
    - RFC 9113 6.5: a SETTINGS frame with ACK and a payload is a FRAME_SIZE_ERROR
      (hyperframe calls it invalid data, which h2 makes PROTOCOL_ERROR);
    - RFC 9113 6.9: a WINDOW_UPDATE's reserved bit is ignored (hyperframe takes it as
      part of the increment, which is then out of range);
    - a frame longer than SETTINGS_MAX_FRAME_SIZE is a FRAME_SIZE_ERROR when its header
      arrives (h2 checks once the whole frame is buffered: up to 16 MiB a connection);
    - a header block held for its CONTINUATION frames is cut at `block_limit` bytes;
    - a WINDOW_UPDATE or PRIORITY frame that is a stream error (_stream_error_code) is
      passed on as a STREAM_ERROR_FRAME (hyperframe would refuse it, a connection error);
    - the frames of most requests (plain_frame: HEADERS in one frame, DATA unpadded) are
      built without hyperframe's parser, as it would build them;
    - receive_data stops after FRAMES_PER_PASS frames, setting `more` if frames are
      left: the caller handles the events, charges its budgets and passes b"" for the
      next frames (h2 would otherwise open, reset and report every stream of a 64 KiB
      read of 9-byte HEADERS frames, 7,000 of them, before any budget is looked at)."""

    stream_errors = 0
    block_limit = 0  # the longest header block held for its CONTINUATIONs (0: h2's backlog)
    taken = 0      # frames parsed since the last add_data
    more = False   # frames left in the buffer when a pass stopped at FRAMES_PER_PASS

    def add_data(self, data: Any) -> None:
        self.taken = 0
        self.more = False
        super().add_data(data)

    def _update_header_buffer(self, f: Any) -> Any:
        """CVE-2024-27316: a header block is held until its END_HEADERS; h2 bounds it at
        64 CONTINUATION frames (1 MiB at the default frame size). Past `block_limit` it
        is the decoder's "header block far beyond any limit" as soon as it arrives."""
        f = super()._update_header_buffer(f)
        held = self._headers_buffer
        if held and self.block_limit and sum(len(x.data) for x in held) > self.block_limit:
            raise h2.exceptions.DenialOfServiceError(
                f"A header block of more than {self.block_limit} bytes is arriving")
        return f

    def partial(self) -> bool:
        """Whether part of a frame, of a header block (CONTINUATION to come) or of the
        client preface has arrived and the rest not yet."""
        return bool(self._data or self._headers_buffer
                    or 0 < self._preamble_len < PREFACE_LENGTH)

    def __next__(self) -> Any:
        data = self._data
        if self.taken >= FRAMES_PER_PASS:
            self.more = len(data) >= 9
            raise StopIteration
        self.taken += 1
        if len(data) >= 9:
            length = int.from_bytes(data[0:3], "big")
            self._validate_frame_length(length)
            kind = data[3]
            if kind <= 1 and len(data) >= 9 + length and not self._headers_buffer:
                f = plain_frame(data, length)
                if f is not None:
                    del data[:9 + length]
                    return f
            if kind in (0x2, 0x8) and len(data) >= 9 + length and data[5:9] != b"\0\0\0\0":
                code = _stream_error_code(kind, int.from_bytes(data[5:9], "big") & 0x7FFFFFFF,
                                          data[9:9 + length])
                if code:
                    data[9:9 + length] = code.to_bytes(4, "big")
                    data[0:5] = b"\0\0\x04" + bytes((STREAM_ERROR_FRAME, 0))
                    self.stream_errors += 1
                    return super().__next__()
            if (kind == 0x4 and data[4] & 0x1 and data[0:3] != b"\0\0\0"
                    and data[5:9] == b"\0\0\0\0"):  # on a stream: PROTOCOL_ERROR stands
                raise h2.exceptions.FrameTooLargeError("SETTINGS ACK frame with a payload")
            if kind == 0x8 and len(data) >= 13 and data[0:3] == b"\0\0\x04":
                data[9] &= 0x7F
        return super().__next__()


class FastReceive:
    """Mixin for h2.connection.H2Connection subclasses (first in the bases):
    - HPACK blocks are decoded by FastDecoder;
    - a SETTINGS ACK with a payload is FRAME_SIZE_ERROR (_FrameBuffer);
    - no repr() of every frame received;
    - streams check received fields with checked_fields();
    - a new stream counts the open ones (a scan of every stream) only when there can be
      enough of them to reach the limit: h2 scans on every HEADERS frame, twice here.
    - RFC 9113 5.1.2 as a stream error (when `refuse_excess`): a HEADERS frame over the
      concurrent stream limit refuses that stream only (h2 itself would end the
      connection); `refused` counts them, for the caller to budget like client resets.
    - RFC 9113 5.1 on closed streams: frames after our own RST_STREAM are ignored, DATA
      after END_STREAM both ways is a connection error (h2 answers both with RST_STREAM).
    - `closed_frames` counts frames on closed streams and frames that raised no event,
      for the caller's idle-frame budget (h2_budgets.FrameBudgets.settle); but for
      WINDOW_UPDATEs on streams that ended (`closed_window_updates`): the peer's answer
      to DATA it read after the stream's end (RFC 9113 6.9), budgeted as such."""

    refuse_excess = False
    refused = 0
    closed_frames = 0     # frames on closed streams, and frames that raised no event
    closed_window_updates = 0  # WINDOW_UPDATEs on streams that have ended
    data_frames_sent = 0  # by send_data

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        old = self.decoder
        self.decoder = FastDecoder(old.max_header_list_size)
        self.decoder.max_allowed_table_size = old.max_allowed_table_size
        self.incoming_buffer.__class__ = _FrameBuffer

    def _receive_frame(self, frame: Any) -> list:
        """h2's H2Connection._receive_frame (4.x) without its trace call, whose argument,
        repr(frame), is built for every frame received even though nothing logs it."""
        if (frame.__class__ is ExtensionFrame and frame.type == STREAM_ERROR_FRAME
                and self.incoming_buffer.stream_errors):
            self.incoming_buffer.stream_errors -= 1
            return self._stream_error(frame.stream_id, int.from_bytes(frame.body, "big"))
        try:
            frames, events = self._frame_dispatch_table[frame.__class__](frame)
        except h2.exceptions.StreamClosedError as e:
            if self._stream_is_closed_by_reset(e.stream_id):
                self._on_reset_stream(e.stream_id, e.error_code, bool(e._events))
                events = e._events
            else:
                raise
        except h2.exceptions.StreamIDTooLowError as e:
            if self._stream_is_closed_by_reset(e.stream_id):
                self._on_reset_stream(e.stream_id, ErrorCodes.STREAM_CLOSED, False)
                events = []
            elif self._stream_is_closed_by_end(e.stream_id):
                raise h2.exceptions.StreamClosedError(e.stream_id) from e
            else:
                raise
        else:
            if frames:
                self._prepare_for_sending(frames)
            if not events:
                # Nothing for the caller to handle (RST_STREAM or WINDOW_UPDATE on a
                # stream gone, say), so nothing of its own would charge it.
                if frame.__class__ is WindowUpdateFrame:
                    self.closed_window_updates += 1
                else:
                    self.closed_frames += 1
        return events

    def _on_reset_stream(self, sid: int, code: int, now: bool) -> None:
        """A frame other than DATA on a stream closed by RST_STREAM (`now`: by the one
        h2 sends for this very frame). RFC 9113 5.1: after the peer's RST_STREAM it is a
        stream error STREAM_CLOSED; after one we sent before it is ignored (it may have
        been in flight; h2 answers it with another RST_STREAM)."""
        self.closed_frames += 1
        if now or self._stream_closed_by(sid) is not h2.stream.StreamClosedBy.SEND_RST_STREAM:
            f = RstStreamFrame(sid)
            f.error_code = code
            self._prepare_for_sending([f])

    def _handle_data_on_closed_stream(self, events: list, exc: Any, frame: Any) -> tuple:
        """DATA on a closed stream (RFC 9113 5.1): after END_STREAM from the peer, a
        connection error STREAM_CLOSED (h2 makes it a stream error); after our own
        RST_STREAM, ignored but for the connection's window (h2 answers RST_STREAM);
        otherwise (half-closed, exc._events has the reset h2 makes of it now; or a
        stream forgotten) a stream error STREAM_CLOSED, as h2 does."""
        closed_by = None if exc._events else self._stream_closed_by(frame.stream_id)
        if closed_by in (h2.stream.StreamClosedBy.RECV_END_STREAM,
                         h2.stream.StreamClosedBy.SEND_END_STREAM):
            raise exc
        self.closed_frames += 1
        frames, events = super()._handle_data_on_closed_stream(events, exc, frame)
        if closed_by is h2.stream.StreamClosedBy.SEND_RST_STREAM:
            frames = [f for f in frames if f.__class__ is not RstStreamFrame]
        return frames, events

    def _begin_new_stream(self, stream_id: int, allowed_ids: Any) -> Any:
        stream = super()._begin_new_stream(stream_id, allowed_ids)
        stream.__class__ = _Stream
        return stream

    def _malformed(self, sid: int, known: bool, reason: str) -> tuple[list, list]:
        """RFC 9113 8.1.1: a malformed request or response is a stream error: the stream
        is reset with PROTOCOL_ERROR and the connection's other streams go on. A stream
        the caller knows of ends with a StreamReset event; a new one counts in
        `refused`, budgeted like a client's reset, and is told as a MalformedStream
        event (for the access log: a request refused before it was one)."""
        if known:
            return [], self._stream_error(sid, ErrorCodes.PROTOCOL_ERROR, reason)
        self.reset_stream(sid, ErrorCodes.PROTOCOL_ERROR)
        self.refused += 1
        self.closed_frames += 1  # as before the event: budgeted as a frame doing nothing
        return [], [MalformedStream(sid, reason)]

    def _stream_error(self, sid: int, code: int, reason: str = "") -> list:
        """Reset an open stream with `code` (its caller learns it as a StreamReset, with
        `reason` why); on an idle or closed stream the frame is dropped (RFC 9113 6.4:
        no RST_STREAM for an idle stream) and counted with the frames that do nothing."""
        stream = self.streams.get(sid)
        if stream is None or stream.closed:
            self.closed_frames += 1
            return []
        self.reset_stream(sid, code)
        event = h2.events.StreamReset(stream_id=sid, error_code=code, remote_reset=False)
        event.reason = reason
        return [event]

    def _receive_data_frame(self, frame: Any) -> tuple[list, list]:
        try:
            return super()._receive_data_frame(frame)
        except h2.exceptions.InvalidBodyLengthError:
            # More DATA than content-length, or less at END_STREAM. h2 has counted the
            # frame against the connection window: give it back, as h2 does for DATA
            # on a closed stream. process_bytes() has already added what it returns to
            # the window: only the WINDOW_UPDATE is left to send (not through
            # increment_flow_control_window, which would add it a second time).
            increment = self._inbound_flow_control_window_manager.process_bytes(
                frame.flow_controlled_length)
            frames, events = self._malformed(frame.stream_id, True, "DATA does not add up "
                                             "to its content-length")
            if increment:
                update = WindowUpdateFrame(0)
                update.window_increment = increment
                frames = [update, *frames]
            return frames, events

    def _receive_headers_frame(self, frame: Any) -> tuple[list, list]:
        sid = frame.stream_id
        streams = self.streams
        known = sid in streams
        if not known and sid > self.highest_inbound_stream_id:  # a new stream
            limit = self.local_settings.max_concurrent_streams
            if len(streams) >= limit and self.open_inbound_streams >= limit:
                if self.refuse_excess and sid % 2 == 1:
                    # Decode the block anyway: the HPACK table must stay in step.
                    h2.connection._decode_headers(self.decoder, frame.data)
                    self.highest_inbound_stream_id = sid
                    self._closed_streams[sid] = h2.stream.StreamClosedBy.SEND_RST_STREAM
                    rst = RstStreamFrame(sid)
                    rst.error_code = ErrorCodes.REFUSED_STREAM
                    self.refused += 1
                    return [rst], []
                raise h2.exceptions.TooManyStreamsError(
                    f"Max inbound streams is {limit}, {self.open_inbound_streams} open")
        # From here as h2.connection.H2Connection._receive_headers_frame (4.x).
        headers = h2.connection._decode_headers(self.decoder, frame.data)
        oversized = self.decoder.oversized
        if oversized and known:
            # a request's trailers (it cannot be answered 431), a response's head or trailers
            what = "response field section" if self.config.client_side else "trailer section"
            return self._malformed(sid, True, f"{what} over max_header_bytes")
        events = self.state_machine.process_input(ConnectionInputs.RECV_HEADERS)
        stream = self._get_or_create_stream(sid, AllowedStreamIDs(not self.config.client_side))
        try:
            frames, stream_events = stream.receive_headers(
                headers, "END_STREAM" in frame.flags, self.config.header_encoding)
        except h2.exceptions.StreamClosedError:
            raise
        except h2.exceptions.ProtocolError as exc:
            if isinstance(exc, h2.exceptions.FlowControlError):
                raise
            if stream.closed:
                if not known:
                    raise
                # Fields with END_STREAM on a stream this side had ended (a response, or
                # its trailers, to a request sent whole; a request's trailers after its
                # response): h2 closed the stream before it checked the fields. Still a
                # stream error alone (8.1.1): the caller hears of it, and no RST_STREAM
                # goes out on a stream closed both ways (5.1).
                event = h2.events.StreamReset(stream_id=sid,
                                              error_code=ErrorCodes.PROTOCOL_ERROR,
                                              remote_reset=False)
                event.reason = str(exc)
                return [], [event]
            return self._malformed(sid, known, str(exc))
        if "PRIORITY" in frame.flags:
            if frame.depends_on == sid:  # RFC 9113 5.3.1: a stream error
                return self._malformed(sid, known, "stream depends on itself")
            p_frames, p_events = self._receive_priority_frame(frame)
            stream_events[0].priority_updated = p_events[0]
            stream_events.extend(p_events)
        if oversized:
            stream_events[0].header_list_too_large = True
        return frames, events + stream_events
