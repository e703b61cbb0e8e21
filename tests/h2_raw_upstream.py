"""A hand-driven HTTP/2 upstream: each connection is given to a test's script in a
thread, which reads the proxy's frames and writes whatever frames it likes (built with
hyperframe or byte by byte), including ones the `h2` library would refuse to send."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import hpack
from hyperframe.frame import (
    DataFrame,
    Frame,
    HeadersFrame,
    RstStreamFrame,
    SettingsFrame,
)

from tests.h2_support import PREFACE, raw_frame
from tests.support import free_port


class RawConn:
    """One accepted connection: frames in, bytes out."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.frames: list[Frame] = []  # every frame read, in order
        self.eof = False
        self._block: list[Any] = []

    def send(self, *frames: Frame | bytes) -> bool:
        try:
            self.sock.sendall(b"".join(f if isinstance(f, bytes) else f.serialize()
                                       for f in frames))
        except OSError:
            return False
        return True

    def recv(self, timeout: float = 5.0) -> Frame | None:
        deadline = time.monotonic() + timeout
        while True:
            if len(self.buf) >= 9:
                n = int.from_bytes(self.buf[:3], "big")
                if len(self.buf) >= 9 + n:
                    frame, _ = Frame.parse_frame_header(memoryview(bytes(self.buf[:9])))
                    frame.parse_body(memoryview(bytes(self.buf[9:9 + n])))
                    del self.buf[:9 + n]
                    if isinstance(frame, HeadersFrame) or type(frame).__name__ == "ContinuationFrame":
                        self._block.append(frame)
                        if "END_HEADERS" in frame.flags:
                            block = b"".join(f.data for f in self._block)
                            self._block = []
                            frame.decoded = self.decoder.decode(block, raw=True)
                    self.frames.append(frame)
                    return frame
            if self.eof:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                return None
            except OSError:
                data = b""
            if not data:
                self.eof = True
                return None
            self.buf += data

    def handshake(self, settings: dict[int, int] | None = None, ack: bool = True) -> None:
        """Reads the client preface; sends our SETTINGS (and ACKs the client's)."""
        deadline = time.monotonic() + 5
        while len(self.buf) < len(PREFACE) and time.monotonic() < deadline:
            self.sock.settimeout(1)
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("no preface")
            self.buf += data
        assert bytes(self.buf[:len(PREFACE)]) == PREFACE
        del self.buf[:len(PREFACE)]
        frames: list[Frame | bytes] = [SettingsFrame(0, settings=settings or {})]
        if ack:
            frames.append(SettingsFrame(0, flags=["ACK"]))
        self.send(*frames)

    def request(self, timeout: float = 10.0) -> tuple[int, list, bool]:
        """Frames until a request's HEADERS: (stream id, fields, END_STREAM on it)."""
        deadline = time.monotonic() + timeout
        while True:
            f = self.recv(max(deadline - time.monotonic(), 0.01))
            if f is None:
                raise TimeoutError("no request")
            if hasattr(f, "decoded"):
                return f.stream_id, f.decoded, "END_STREAM" in f.flags

    def until(self, pred: Callable[[Frame], bool], timeout: float = 5.0) -> Frame | None:
        deadline = time.monotonic() + timeout
        while True:
            f = self.recv(max(deadline - time.monotonic(), 0.01))
            if f is None or pred(f):
                return f

    def headers(self, sid: int, fields: list[tuple[bytes, bytes]], end: bool = False,
                flags: int = 0x4) -> bytes:
        return raw_frame(0x1, flags | (0x1 if end else 0), sid, self.encoder.encode(fields))

    @staticmethod
    def data(sid: int, payload: bytes, end: bool = False) -> bytes:
        return raw_frame(0x0, 0x1 if end else 0, sid, payload)

    @staticmethod
    def rst(sid: int, code: int) -> bytes:
        return raw_frame(0x3, 0, sid, code.to_bytes(4, "big"))

    def resets(self) -> list[RstStreamFrame]:
        return [f for f in self.frames if isinstance(f, RstStreamFrame)]

    def data_bytes(self, sid: int) -> int:
        return sum(len(f.data) for f in self.frames
                   if isinstance(f, DataFrame) and f.stream_id == sid)


class RawUpstream:
    """Listens on 127.0.0.1; each connection runs script(conn) in its own thread."""

    def __init__(self, script: Callable[[RawConn], None]) -> None:
        self.script = script
        self.conns: list[RawConn] = []
        self.errors: list[BaseException] = []
        self.port = free_port()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(16)
        self.threads: list[threading.Thread] = []
        self.stopped = False
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self.threads.append(t)

    def _accept(self) -> None:
        while not self.stopped:
            try:
                s, _ = self.sock.accept()
            except OSError:
                return
            conn = RawConn(s)
            self.conns.append(conn)
            t = threading.Thread(target=self._run, args=(conn,), daemon=True)
            t.start()
            self.threads.append(t)

    def _run(self, conn: RawConn) -> None:
        try:
            self.script(conn)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)
        finally:
            try:
                conn.sock.close()
            except OSError:
                pass

    def stop(self) -> None:
        self.stopped = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() (a close does not)
        except OSError:
            pass
        self.sock.close()
        for c in self.conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self.threads:
            t.join(5)
