"""HTTP/2 test helpers: a raw frame client, a small h2c upstream, certificates.

`FrameClient` writes exactly the frames a test builds (hyperframe + its own HPACK
encoder) and reads frames back without an HTTP/2 state machine of its own, so it can
send what a well-behaved client never would. `H2Upstream` is an h2c server on the
`h2` library in a thread, for HTTP/1.1 -> HTTP/2 translation and for upstream
behaviour grpcio does not offer (ignoring grpc-timeout, hanging, recording resets).
`make_pki` builds a CA, a server certificate for 127.0.0.1 and a client certificate
with the openssl CLI.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hpack
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from tests.conftest import CRASH_MARKERS
from tests.support import (  # noqa: F401 (RssMonitor, rss_bytes re-exported for the h2 tests)
    RssMonitor,
    free_port,
    process_log,
    rss_bytes,
    start_process,
    stop_process,
    wait_port,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
BLOCK = bytes(range(256)) * 256  # 64 KiB: the demo upstream's /bytes/N pattern


def bytes_sha256(n: int) -> str:
    digest = hashlib.sha256()
    full, rest = divmod(n, len(BLOCK))
    for _ in range(full):
        digest.update(BLOCK)
    digest.update(BLOCK[:rest])
    return digest.hexdigest()


# -- raw frames ---------------------------------------------------------------------------


def raw_frame(ftype: int, flags: int, sid: int, payload: bytes, length: int | None = None) -> bytes:
    """A frame built byte by byte (the length field may lie)."""
    n = len(payload) if length is None else length
    return n.to_bytes(3, "big") + bytes([ftype, flags]) + (sid & 0x7FFFFFFF).to_bytes(4, "big") + payload


class FrameClient:
    """A blocking client socket speaking raw HTTP/2 frames."""

    def __init__(self, port: int, timeout: float = 10.0, tls: ssl.SSLContext | None = None,
                 rcvbuf: int | None = None) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(timeout)
        sock.connect(("127.0.0.1", port))
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname="127.0.0.1")
        self.sock = sock
        self.buf = bytearray()
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = 1 << 20
        self.eof = False
        self.stash: list[Frame] = []  # frames of other streams read by response()
        self._block: list[Any] = []  # HEADERS + CONTINUATION frames of the block being read

    def __enter__(self) -> FrameClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    # -- writing ------------------------------------------------------------------

    def send(self, *frames: Frame | bytes) -> None:
        self.sock.sendall(b"".join(f if isinstance(f, bytes) else f.serialize() for f in frames))

    def try_send(self, *frames: Frame | bytes) -> bool:
        """send() that reports a connection the peer has closed instead of raising."""
        try:
            self.send(*frames)
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    def handshake(self, settings: dict[int, int] | None = None, window: int = 0) -> None:
        """Preface + SETTINGS (+ a connection WINDOW_UPDATE); ACKs the server's SETTINGS
        when it arrives (later reads do that too)."""
        sf = SettingsFrame(0, settings=settings or {})
        frames: list[Frame | bytes] = [PREFACE, sf]
        if window:
            frames.append(WindowUpdateFrame(0, window_increment=window))
        self.send(*frames)

    def encode(self, headers: list[tuple[str | bytes, str | bytes]]) -> bytes:
        return self.encoder.encode(headers)

    def headers(self, sid: int, headers: list[tuple[str | bytes, str | bytes]],
                end_stream: bool = True) -> HeadersFrame:
        f = HeadersFrame(sid)
        f.data = self.encode(headers)
        f.flags.add("END_HEADERS")
        if end_stream:
            f.flags.add("END_STREAM")
        return f

    def request(self, sid: int, path: str = "/echo", method: str = "GET",
                extra: list[tuple[str, str]] | None = None, end_stream: bool = True,
                authority: str = "test") -> HeadersFrame:
        fields: list[tuple[str | bytes, str | bytes]] = [
            (":method", method), (":scheme", "http"), (":path", path),
            (":authority", authority)]
        fields += extra or []
        return self.headers(sid, fields, end_stream)

    # -- reading ------------------------------------------------------------------

    def _fill(self, timeout: float) -> bool:
        self.sock.settimeout(max(timeout, 0.001))
        try:
            data = self.sock.recv(1 << 20)
        except TimeoutError:
            return False
        except (ConnectionResetError, ssl.SSLError, OSError):
            data = b""
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    def recv(self, timeout: float = 5.0, auto_ack: bool = True) -> Frame | None:
        """The next frame, or None on EOF/timeout (self.eof tells which). SETTINGS from
        the server is acknowledged and PING answered unless auto_ack is False."""
        deadline = time.monotonic() + timeout
        while True:
            if len(self.buf) >= 9:
                length = int.from_bytes(self.buf[:3], "big")
                if len(self.buf) >= 9 + length:
                    frame, _ = Frame.parse_frame_header(memoryview(bytes(self.buf[:9])))
                    frame.parse_body(memoryview(bytes(self.buf[9:9 + length])))
                    del self.buf[:9 + length]
                    self._after(frame, auto_ack)
                    return frame
            if self.eof:
                return None
            left = deadline - time.monotonic()
            if left <= 0 or not self._fill(left):
                if self.eof or time.monotonic() >= deadline:
                    return None

    def _after(self, frame: Frame, auto_ack: bool) -> None:
        if isinstance(frame, (HeadersFrame, ContinuationFrame)):
            self._block.append(frame)
            if "END_HEADERS" in frame.flags:
                block = b"".join(f.data for f in self._block)
                self._block = []
                frame.decoded = self.decoder.decode(block, raw=True)  # type: ignore[attr-defined]
        if not auto_ack:
            return
        try:
            if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
                self.send(SettingsFrame(0, flags=["ACK"]))
            elif isinstance(frame, PingFrame) and "ACK" not in frame.flags:
                self.send(PingFrame(0, opaque_data=frame.opaque_data, flags=["ACK"]))
        except OSError:
            pass

    def frames_until(self, pred: Callable[[Frame], bool], timeout: float = 5.0) -> list[Frame]:
        """Frames read until one satisfies pred (included), EOF or timeout."""
        out = []
        deadline = time.monotonic() + timeout
        while True:
            frame = self.recv(max(deadline - time.monotonic(), 0.001))
            if frame is None:
                return out
            out.append(frame)
            if pred(frame):
                return out

    def goaway(self, timeout: float = 5.0) -> GoAwayFrame | None:
        frames = self.frames_until(lambda f: isinstance(f, GoAwayFrame), timeout)
        return frames[-1] if frames and isinstance(frames[-1], GoAwayFrame) else None

    def closed_after(self, timeout: float = 5.0) -> bool:
        """Reads (and drops) frames until EOF; True if the server closed within timeout."""
        deadline = time.monotonic() + timeout
        while not self.eof and time.monotonic() < deadline:
            self.recv(deadline - time.monotonic())
        return self.eof

    def response(self, sid: int, timeout: float = 10.0) -> H2Response:
        """Reads until stream sid ends (or is reset); returns what arrived on it. Frames
        of other streams read meanwhile are kept for their own response() call; DATA is
        acknowledged with WINDOW_UPDATE as it is read."""
        resp = H2Response()
        stash, self.stash = self.stash, []
        for i, frame in enumerate(stash):
            if frame.stream_id == sid and self._take(frame, resp):
                self.stash += stash[i + 1:]
                return resp
            if frame.stream_id != sid:
                self.stash.append(frame)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            frame = self.recv(left) if left > 0 else None
            if frame is None:
                raise TimeoutError(f"stream {sid} did not end (eof={self.eof}); got {resp}")
            if isinstance(frame, DataFrame) and frame.flow_controlled_length:
                n = frame.flow_controlled_length
                self.try_send(WindowUpdateFrame(0, window_increment=n),
                              WindowUpdateFrame(frame.stream_id, window_increment=n))
            if isinstance(frame, GoAwayFrame):
                resp.goaway = frame
                if frame.last_stream_id < sid:
                    return resp
            if frame.stream_id != sid:
                if frame.stream_id:
                    self.stash.append(frame)
                continue
            if self._take(frame, resp):
                return resp

    @staticmethod
    def _take(frame: Frame, resp: H2Response) -> bool:
        """Adds a frame of the stream to resp; True when the stream is over."""
        if isinstance(frame, (HeadersFrame, ContinuationFrame)) and hasattr(frame, "decoded"):
            if resp.headers is None:
                resp.headers = frame.decoded
            else:
                resp.trailers = frame.decoded
        elif isinstance(frame, DataFrame):
            resp.body += frame.data
            resp.data_sizes.append(len(frame.data))
        elif isinstance(frame, RstStreamFrame):
            resp.reset = frame.error_code
            return True
        return "END_STREAM" in frame.flags


@dataclass
class H2Response:
    headers: list[tuple[bytes, bytes]] | None = None
    body: bytearray = field(default_factory=bytearray)  # grown in place: MiBs in 16 KiB frames
    trailers: list[tuple[bytes, bytes]] | None = None
    reset: int | None = None
    goaway: GoAwayFrame | None = None
    data_sizes: list[int] = field(default_factory=list)  # of each DATA frame, in order

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers or []:
            if k == name:
                return v
        return None

    @property
    def status(self) -> int | None:
        value = self.header(b":status")
        return int(value) if value is not None else None


def h2_get(port: int, path: str = "/echo", timeout: float = 10.0) -> H2Response:
    """One request from a fresh, well-behaved raw HTTP/2 client."""
    with FrameClient(port, timeout) as c:
        c.handshake()
        c.send(c.request(1, path))
        return c.response(1, timeout)


class H2LibClient:
    """A blocking h2c client on the `h2` library's own state machine and HPACK encoder
    (which indexes fields into its dynamic table, so a server whose decoder falls out
    of step with it misreads later requests)."""

    def __init__(self, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding=None))
        self.conn.initiate_connection()
        self.responses: dict[int, H2Response] = {}
        self.ended: set[int] = set()
        self.terminated: h2.events.ConnectionTerminated | None = None
        self.eof = False
        self._flush()

    def __enter__(self) -> H2LibClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def request(self, path: str = "/echo", extra: list[tuple[str, str]] | None = None,
                method: str = "GET") -> int:
        sid = self.conn.get_next_available_stream_id()
        fields = [(":method", method), (":scheme", "http"), (":path", path),
                  (":authority", "test"), *(extra or [])]
        self.conn.send_headers(sid, [(k.encode(), v.encode()) for k, v in fields],
                               end_stream=True)
        self.responses[sid] = H2Response()
        self._flush()
        return sid

    def response(self, sid: int, timeout: float = 10.0) -> H2Response:
        """Reads until stream sid ends or is reset (or the connection ends)."""
        deadline = time.monotonic() + timeout
        while sid not in self.ended and not self.eof and self.terminated is None:
            self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                raise TimeoutError(f"stream {sid} did not end") from None
            except OSError:
                data = b""
            if not data:
                self.eof = True
                break
            for ev in self.conn.receive_data(data):
                self._event(ev)
            self._flush()
        return self.responses[sid]

    def _event(self, ev: Any) -> None:
        if isinstance(ev, h2.events.ResponseReceived):
            self.responses[ev.stream_id].headers = list(ev.headers)
        elif isinstance(ev, h2.events.DataReceived):
            self.responses[ev.stream_id].body += ev.data
            self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        elif isinstance(ev, h2.events.StreamEnded):
            self.ended.add(ev.stream_id)
        elif isinstance(ev, h2.events.StreamReset):
            self.responses[ev.stream_id].reset = ev.error_code
            self.ended.add(ev.stream_id)
        elif isinstance(ev, h2.events.ConnectionTerminated):
            self.terminated = ev


# -- a small h2c upstream ------------------------------------------------------------------


class _UpstreamProtocol(asyncio.Protocol):
    def __init__(self, server: H2Upstream) -> None:
        self.server = server
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding=None))
        self.transport: asyncio.Transport | None = None
        self.bodies: dict[int, bytearray] = {}
        self.heads: dict[int, list[tuple[bytes, bytes]]] = {}
        self.trailers: dict[int, list[tuple[bytes, bytes]]] = {}
        self.windows: dict[int, asyncio.Event] = {}
        self.tasks: set[asyncio.Task] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections += 1
        self.server.record("made")
        self.server.protocols.append(self)
        if self.server.settings_delay:
            # Its SETTINGS come late: the proxy waits for them before it sends a request.
            asyncio.get_running_loop().call_later(self.server.settings_delay, self._start)
        else:
            self._start()

    def _start(self) -> None:
        self.conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.server.max_streams})
        self.conn.initiate_connection()
        self.flush()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.record("lost")
        for task in self.tasks:
            task.cancel()
        for ev in self.windows.values():
            ev.set()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            self.server.record("protocol_error", str(exc))
            self.flush()
            self.transport.close()
            return
        for ev in events:
            if isinstance(ev, h2.events.RequestReceived):
                self.heads[ev.stream_id] = ev.headers
                self.bodies[ev.stream_id] = bytearray()
                self.server.record("request", ev.stream_id, ev.headers)
                if ev.stream_ended:
                    self._dispatch(ev.stream_id)
            elif isinstance(ev, h2.events.DataReceived):
                path = dict(self.heads.get(ev.stream_id, [])).get(b":path", b"")
                self.server.record("data", ev.stream_id, len(ev.data))
                if b"stall" in path.lower():
                    continue  # never acknowledged: the sender's window runs dry
                self.bodies.setdefault(ev.stream_id, bytearray()).extend(ev.data)
                self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.TrailersReceived):
                self.trailers[ev.stream_id] = ev.headers
                self.server.record("trailers", ev.stream_id, ev.headers)
            elif isinstance(ev, h2.events.StreamEnded):
                self._dispatch(ev.stream_id)
            elif isinstance(ev, h2.events.StreamReset):
                self.server.record("reset", ev.stream_id, ev.error_code)
                w = self.windows.get(ev.stream_id)
                if w is not None:
                    w.set()
            elif isinstance(ev, h2.events.WindowUpdated):
                for sid, w in self.windows.items():
                    if ev.stream_id in (0, sid):
                        w.set()
            elif isinstance(ev, h2.events.RemoteSettingsChanged):
                for w in self.windows.values():
                    w.set()
        self.flush()

    def _dispatch(self, sid: int) -> None:
        head = dict(self.heads.get(sid, []))
        body = bytes(self.bodies.get(sid, b""))
        self.server.record("complete", sid, len(body))
        task = asyncio.get_running_loop().create_task(self._respond(sid, head, body))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _respond(self, sid: int, head: dict[bytes, bytes], body: bytes) -> None:
        path = head.get(b":path", b"/").decode()
        try:
            await self.server.handler(self, sid, path, head, body)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass
        self.flush()

    async def send_data(self, sid: int, data: bytes, end: bool = False) -> bool:
        """Send respecting flow control; False if the stream went away."""
        view = memoryview(data)
        while view:
            try:
                window = min(self.conn.local_flow_control_window(sid),
                             self.conn.max_outbound_frame_size)
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError, KeyError):
                return False
            if window <= 0:
                ev = self.windows.setdefault(sid, asyncio.Event())
                ev.clear()
                await ev.wait()
                if self.transport is None or self.transport.is_closing():
                    return False
                continue
            self.conn.send_data(sid, bytes(view[:window]))
            view = view[window:]
            self.flush()
        if end:
            self.conn.end_stream(sid)
            self.flush()
        return True


# One frame of each kind a hostile upstream floods with, for stream `sid`.
FLOODS: dict[str, Callable[[int], bytes]] = {
    "ping": lambda sid: raw_frame(0x6, 0, 0, b"\0" * 8),
    "settings": lambda sid: raw_frame(0x4, 0, 0, b""),
    "empty_data": lambda sid: raw_frame(0x0, 0, sid, b""),
    "priority": lambda sid: raw_frame(0x2, 0, sid, b"\0\0\0\0\x10"),
    "window_update": lambda sid: raw_frame(0x8, 0, 0, (1).to_bytes(4, "big")),
    "unknown": lambda sid: raw_frame(0xFA, 0, 0, b""),
}


async def default_handler(proto: _UpstreamProtocol, sid: int, path: str,
                          head: dict[bytes, bytes], body: bytes) -> None:
    """/echo: JSON about the request; /bytes/N[?length=1]: pattern bytes; /hang: nothing;
    a path with "stall" in it: nothing, and request DATA is never acknowledged; /sleep/MS: "ok" after MS;
    /trailers: body then trailers; /status/N: that status; /status-with-body/N: that
    status with a body that looks like a response; /reset-before-head and
    /reset-after-head: RST_STREAM(INTERNAL_ERROR) before or in the middle of a response;
    /flood/KIND: 20,000 frames of one kind that carry no response (see FLOODS), then the
    response; /tokens/N: N DATA frames of 6 bytes, as a token stream sends them."""
    conn = proto.conn
    if path.startswith("/flood/"):
        kind = path[7:]
        flood = FLOODS[kind](sid) * 20000
        if kind == "empty_data":  # DATA may only follow the head
            conn.send_headers(sid, [(b":status", b"200")])
            proto.flush()
        proto.transport.write(flood)
        if kind != "empty_data":
            conn.send_headers(sid, [(b":status", b"200")])
        await proto.send_data(sid, b"the flood went unnoticed", end=True)
        return
    if path.startswith("/tokens/"):
        conn.send_headers(sid, [(b":status", b"200"), (b"content-type", b"text/plain")])
        for i in range(int(path[8:])):
            if not await proto.send_data(sid, b"tok%03d" % (i % 1000)):
                return
            if i % 64 == 63:
                await asyncio.sleep(0)  # let the frames go out as a stream would send them
        conn.end_stream(sid)
        return
    if path.startswith("/hang") or "stall" in path.lower():
        return
    if path.startswith("/sleep/"):
        await asyncio.sleep(int(path[7:]) / 1000)
        conn.send_headers(sid, [(b":status", b"200"), (b"content-length", b"2")])
        await proto.send_data(sid, b"ok", end=True)
        return
    if path.startswith("/bytes/"):
        spec = path[7:]
        n = int(spec.split("?")[0])
        fields = [(b":status", b"200"), (b"content-type", b"application/octet-stream")]
        if "length=1" in spec:
            fields.append((b"content-length", str(n).encode()))
        if head.get(b":method") == b"HEAD":
            conn.send_headers(sid, fields, end_stream=True)
            return
        conn.send_headers(sid, fields)
        proto.flush()
        sent = 0
        while sent < n:
            piece = min(len(BLOCK), n - sent)
            if not await proto.send_data(sid, BLOCK[:piece]):
                return
            sent += piece
        conn.end_stream(sid)
        return
    if path.startswith("/reset-before-head"):
        conn.reset_stream(sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
        return
    if path.startswith("/reset-after-head"):
        conn.send_headers(sid, [(b":status", b"200"), (b"content-type", b"text/plain")])
        await proto.send_data(sid, b"partial body")
        await asyncio.sleep(0.2)
        conn.reset_stream(sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
        return
    if path.startswith("/trailers"):
        conn.send_headers(sid, [(b":status", b"200"), (b"content-type", b"text/plain")])
        await proto.send_data(sid, b"body-before-trailers")
        conn.send_headers(sid, [(b"x-trailer", b"t1"), (b"x-other", b"t2")], end_stream=True)
        return
    if path.startswith("/status-with-body/"):  # what no 204/304 may carry (RFC 9113 8.1.1)
        conn.send_headers(sid, [(b":status", path[18:21].encode())])
        await proto.send_data(sid, b"HTTP/1.1 200 OK\r\nX-Injected: 1\r\n\r\n", end=True)
        return
    if path.startswith("/status/"):
        code = int(path[8:11])
        conn.send_headers(sid, [(b":status", str(code).encode()), (b"content-length", b"0")],
                          end_stream=True)
        return
    doc = json.dumps({
        "method": head.get(b":method", b"").decode(),
        "path": path,
        "authority": head.get(b":authority", b"").decode(),
        "headers": [[k.decode(), v.decode("latin-1")] for k, v in head.items()],
        "trailers": [[k.decode(), v.decode("latin-1")]
                     for k, v in proto.trailers.get(sid, [])],
        "body_bytes": len(body),
        "body_sha256": hashlib.sha256(body).hexdigest(),
        "upstream": proto.server.name,
    }).encode()
    conn.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/json"),
                            (b"content-length", str(len(doc)).encode())])
    await proto.send_data(sid, doc, end=True)


class H2Upstream:
    """An h2c (prior knowledge) server on 127.0.0.1 in its own thread."""

    def __init__(self, handler: Callable[..., Any] = default_handler, name: str = "h2-up",
                 max_streams: int = 100, settings_delay: float = 0.0) -> None:
        self.handler = handler
        self.name = name
        self.max_streams = max_streams
        self.settings_delay = settings_delay
        self.connections = 0
        self.protocols: list[_UpstreamProtocol] = []  # every connection it accepted
        self.events: list[tuple] = []
        self.lock = threading.Condition()
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        if not ready.wait(10):
            raise RuntimeError("h2 upstream did not start")

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            self.srv = await self.loop.create_server(lambda: _UpstreamProtocol(self),
                                                     "127.0.0.1", 0)
            self.port = self.srv.sockets[0].getsockname()[1]

        self.loop.run_until_complete(start())
        ready.set()
        self.loop.run_forever()

    def record(self, *event: Any) -> None:
        with self.lock:
            self.events.append((time.monotonic(), *event))
            self.lock.notify_all()

    def wait_event(self, kind: str, timeout: float) -> tuple | None:
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                for ev in self.events:
                    if ev[1] == kind:
                        return ev
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.lock.wait(left)

    def update_settings(self, max_streams: int) -> None:
        """A new SETTINGS_MAX_CONCURRENT_STREAMS on every open connection (and for new
        ones)."""
        def _update() -> None:
            self.max_streams = max_streams
            for proto in self.protocols:
                if proto.transport is not None and not proto.transport.is_closing():
                    proto.conn.update_settings(
                        {h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_streams})
                    proto.flush()

        self.loop.call_soon_threadsafe(_update)

    def stop(self) -> None:
        def _stop() -> None:
            self.srv.close()
            self.loop.stop()

        self.loop.call_soon_threadsafe(_stop)
        self.thread.join(5)


# -- certificates -----------------------------------------------------------------------------


@dataclass
class Pki:
    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path
    other_client_cert: Path  # signed by a different CA
    other_client_key: Path


def _openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> Pki:
    d.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    for ca in ("ca", "ca2"):
        _openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2",
                 "-subj", f"/CN=aiproxy test {ca}", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                  "extendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, ca, ext in (("server", "ca", "server.ext"), ("client", "ca", "client.ext"),
                          ("other", "ca2", "client.ext")):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", ext, cwd=d)
    return Pki(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem",
               d / "client.key", d / "other.pem", d / "other.key")


def client_tls(pki: Pki | None = None, alpn: tuple[str, ...] = ("h2",),
               cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # Python 3.11.0-3.11.2 set it by default (gh-95494): a bare TCP close read as close_notify.
    ctx.options &= ~getattr(ssl, "OP_IGNORE_UNEXPECTED_EOF", 0)
    if pki is not None:
        ctx.load_verify_locations(pki.ca)
    else:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cert is not None:
        ctx.load_cert_chain(*cert)
    ctx.set_alpn_protocols(list(alpn))
    return ctx


# -- a proxy process with several listeners -----------------------------------------------


class ProxyProc:
    """`python -m aiproxy -c` with a config written from `text`; a "{name}" in `text`
    for each name in `listeners` becomes a free port (ports[name])."""

    def __init__(self, tmp_dir: Path, text: str, listeners: tuple[str, ...] = ("port",)) -> None:
        self.ports = {name: free_port() for name in listeners}
        self.config_path = tmp_dir / f"aiproxy-{self.ports[listeners[0]]}.toml"
        for name, port in self.ports.items():
            text = text.replace("{" + name + "}", str(port))
        self.config_path.write_text(text)
        self.proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(self.config_path)])
        try:
            for port in self.ports.values():
                wait_port("127.0.0.1", port, proc=self.proc)
        except BaseException:
            stop_process(self.proc)
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return process_log(self.proc)

    def stop(self) -> str:
        """SIGTERM; fails the test if the proxy let an exception escape."""
        log = stop_process(self.proc, timeout=15)
        crashed = [m for m in CRASH_MARKERS if m in log]
        assert not crashed, f"proxy log shows an escaped exception:\n{log[-20000:]}"
        return log


# -- memory ----------------------------------------------------------------------------------


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True
