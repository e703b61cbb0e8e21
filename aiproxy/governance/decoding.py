"""Undo a response's content coding so a filter can read (and change) its text.

gzip and deflate with the stdlib's zlib; anything else (br, zstd, compress, stacked
codings) is refused: `decoder_for` returns None and the caller fails closed.
"""

from __future__ import annotations

import zlib

from aiproxy.pipeline.filters import UpstreamBodyError

# A bound on what one read of compressed data may expand to (deflate reaches ~1000:1):
# a decompression bomb ends the response instead of filling memory.
MAX_EXPANSION = 32 * 1024 * 1024


class DecodeError(UpstreamBodyError):
    """The upstream's body is not valid data of its content coding."""


class Decoder:
    """Streaming gzip/deflate decoder. `deflate` is meant to be zlib-wrapped (RFC 9110
    8.4.1.2) but some servers send raw deflate: the first two bytes tell."""

    __slots__ = ("coding", "z", "head")

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self.z: zlib._Decompress | None = None  # made at the first bytes
        self.head = b""

    def feed(self, data: bytes) -> bytes:
        if self.z is None:
            self.head += data
            if len(self.head) < 2:
                return b""
            if self.coding == "gzip":
                wbits = 16 + zlib.MAX_WBITS
            else:
                b0, b1 = self.head[0], self.head[1]
                wrapped = b0 & 0x0F == 8 and (b0 << 8 | b1) % 31 == 0
                wbits = zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS
            self.z = zlib.decompressobj(wbits)
            data, self.head = self.head, b""
        try:
            out = self.z.decompress(data, MAX_EXPANSION)
        except zlib.error as exc:
            raise DecodeError(f"bad {self.coding} data: {exc}") from None
        if self.z.unconsumed_tail:
            raise DecodeError(f"{self.coding} data expands past {MAX_EXPANSION} bytes per read")
        return out

    def end(self) -> bytes:
        """The rest; DecodeError if the compressed stream is cut short."""
        if self.z is None:
            if self.head:
                raise DecodeError(f"truncated {self.coding} data")
            return b""  # no body at all (HEAD, 204, 304)
        try:
            out = self.z.flush()
        except zlib.error as exc:
            raise DecodeError(f"bad {self.coding} data: {exc}") from None
        if not self.z.eof:
            raise DecodeError(f"truncated {self.coding} data")
        return out


def decoder_for(encoding: bytes) -> Decoder | None:
    """A decoder for a Content-Encoding value, None if it cannot be decoded here."""
    codings = [c.strip().lower() for c in encoding.split(b",")]
    codings = [c for c in codings if c and c != b"identity"]
    if len(codings) != 1:
        return None
    coding = codings[0]
    if coding in (b"gzip", b"x-gzip"):
        return Decoder("gzip")
    if coding == b"deflate":
        return Decoder("deflate")
    return None
