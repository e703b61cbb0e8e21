"""UnifiedRequest: what a request means to the router, whatever its wire format.

`extract(content_type, body, query)` looks at (at most) the bytes it is given — the
caller passes the first `inspect_bytes` of a body — and returns the text that matters
plus metadata:

* OpenAI-style JSON: `messages[].content` (a string or a list of parts with type
  "text"/"input_text"), `prompt`, `input` (string, list of strings or of messages), and
  any configured JSON fields (dotted paths: "a.b.c"); image/audio parts are counted and
  `data:` URLs sniffed for image/audio headers. A JSON body cut short by the inspect limit
  is scanned leniently for the same keys' string values.
* gRPC (5-byte frame prefix) and protobuf payloads, read without their schema: the wire
  format is walked and length-delimited fields that decode as printable UTF-8 are taken
  as text, others tried as nested messages.
* images: width x height and format from PNG/JPEG/GIF/WebP headers;
* audio: sample rate, channels and duration from WAV/FLAC/MP3/OGG (Vorbis/Opus) headers;
* the query string's values, form bodies (urlencoded, and multipart: its text and JSON
  parts read as above, its files sniffed as images or audio; its first MAX_FORM_PARTS
  parts only), plain text; body size and content type.

Nothing here raises on malformed or truncated input: what cannot be read is left out.
"""

from __future__ import annotations

import base64
import binascii
import email.parser
import email.policy
import enum
import json
import random
import re
import struct
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any
from urllib.parse import parse_qsl

import orjson

from aiproxy import wirejson
from aiproxy._fast.chat_json import chat_text
from aiproxy.wirejson import valid_text

__all__ = ["Modality", "UnifiedRequest", "extract", "sniff_media", "protobuf_strings",
           "form_parts", "is_json_type"]

MAX_TEXT_PARTS = 256
PROTOBUF_TYPES = frozenset(("application/x-protobuf", "application/protobuf",
                            "application/vnd.google.protobuf"))
MAX_PB_DEPTH = 8
_unpack_from = struct.unpack_from


class Modality(enum.IntEnum):
    TEXT = 0
    IMAGE = 1
    AUDIO = 2
    BINARY = 3


# The members as module constants: reading Modality.TEXT goes through the enum
# metaclass's attribute hook, a few hundred instructions on a per-request path.
TEXT, IMAGE, AUDIO, BINARY = Modality.TEXT, Modality.IMAGE, Modality.AUDIO, Modality.BINARY


@dataclass(slots=True)
class UnifiedRequest:
    id: str
    modality: Modality
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


def _new_id() -> str:
    # A label for logs and caches, not a secret: no getrandom() system call per request.
    return f"{random.getrandbits(64):016x}"


def extract(content_type: bytes, body: bytes, query: bytes = b"",
            json_fields: tuple[str, ...] = (), *, request_id: str | None = None,
            body_size: int | None = None) -> UnifiedRequest:
    """Build the UnifiedRequest of one request. `body` is at most inspect_bytes of the body;
    `body_size` is the whole body's size when known (Content-Length), else len(body)."""
    modality, text, meta = _collect(content_type, body, query, json_fields, body_size)
    return UnifiedRequest(request_id or _new_id(), modality, text, meta)


def extract_text(content_type: bytes, body: bytes, query: bytes = b"",
                 json_fields: tuple[str, ...] = (), body_size: int | None = None,
                 decoded_budget: int | None = None) -> str:
    """The text `extract` would find, without the rest of the UnifiedRequest (no id):
    what the router classifies. `decoded_budget`: the bytes of gRPC messages read in
    all, compressed ones counted decoded (the router's inspect_bytes)."""
    if body and not query and type(body) is bytes:
        # The common case (a JSON API call) without the metadata nobody reads here.
        ctype = _media_type(content_type)
        if is_json_type(ctype) or (not ctype and body[:1] in b"{["):
            # In C from the bytes; then by parsing the document; then the full path.
            text = None if json_fields else chat_text(body)
            if text is None:
                text = _json_text(body, json_fields)
            if text is not None:
                return text
    return _collect(content_type, body, query, json_fields, body_size, decoded_budget)[1]


def _collect(content_type: bytes, body: bytes, query: bytes, json_fields: tuple[str, ...],
             body_size: int | None, decoded_budget: int | None = None
             ) -> tuple[Modality, str, dict[str, Any]]:
    body = bytes(body) if not isinstance(body, bytes) else body
    ctype = _media_type(content_type)
    size = len(body) if body_size is None else int(body_size)
    meta: dict[str, Any] = {"content_type": ctype, "body_size": size}
    if size > len(body):
        meta["truncated"] = True
    parts: list[str] = []
    modality = TEXT
    try:
        modality = _extract_body(ctype, body, json_fields, parts, meta, size, content_type,
                                 decoded_budget)
    except Exception as exc:  # pragma: no cover - last-resort guard: never fail a request
        meta["extract_error"] = type(exc).__name__
        modality = BINARY if body else TEXT
    if query:
        q = query[1:] if query[:1] == b"?" else query
        try:
            for _, value in parse_qsl(q.decode("utf-8", "replace"), keep_blank_values=False):
                if value:
                    parts.append(value)
        except ValueError:
            pass
    text = valid_text(_joined(parts))  # json's \ud800 escapes, say: every reader encodes it
    if text and modality == BINARY:
        modality = TEXT
    return modality, text, meta


def _joined(parts: list[str]) -> str:
    if len(parts) == 1:
        return parts[0]
    return "\n".join(p for p in parts[:MAX_TEXT_PARTS] if p)


_MEDIA_TYPES: dict[bytes, str] = {}  # Content-Type field -> media type, bounded


def _media_type(content_type: bytes | str | None) -> str:
    if not content_type:
        return ""
    if isinstance(content_type, bytes):
        media = _MEDIA_TYPES.get(content_type)
        if media is None:
            media = content_type.decode("latin-1").split(";", 1)[0].strip().lower()
            if len(_MEDIA_TYPES) < 256:  # clients send a handful of distinct values
                _MEDIA_TYPES[content_type] = media
        return media
    return content_type.split(";", 1)[0].strip().lower()


def media_type(content_type: bytes | str | None) -> str:
    """A Content-Type field's media type: lower case, without parameters."""
    return _media_type(content_type)


def is_json_type(media: str) -> bool:
    """Whether a media type (lower case, no parameters) is JSON."""
    return media.endswith(("/json", "/x-json", "+json"))


# compat32, not HTTP: the same parts, payloads and charsets (form_parts reads only the
# Content-Type, Content-Transfer-Encoding and payload), without a header object from
# the header registry per field: several times less work per part.
_MIME = email.parser.BytesParser(policy=email.policy.compat32)
# At most this many parts of a multipart body are parsed: the MIME parser costs some
# microseconds per part, on the event loop (a 64 KiB body of tiny parts holds over a
# thousand). Forms sent to AI APIs have a handful.
MAX_FORM_PARTS = 64


@lru_cache(maxsize=64)
def _delimiter(boundary: bytes) -> re.Pattern[bytes]:
    """A delimiter line of `boundary` as the stdlib MIME parser reads one, less the
    check that it starts a line: "--" + boundary, "--" for the close delimiter, spaces
    or tabs, then the line's end (CRLF, CR or LF; not consumed). It starts with the
    literal, so the scan runs at memory search speed."""
    return re.compile(b"--" + re.escape(boundary) + rb"(--)?[ \t]*(?=[\r\n]|\Z)")


_EOL = re.compile(rb"\r\n|\r|\n")


def form_parts(content_type: bytes, body: bytes, limit: int = MAX_FORM_PARTS
               ) -> tuple[list[tuple[str, bytes, str | None]], bool]:
    """(media type, content, charset) of each of the first `limit` parts of a
    multipart/form-data body, and whether parts were left unread: the body has more
    than `limit`, or its boundary string more than `limit` times inside the content
    (it is chosen not to occur there). The parts and each part's header block are found
    by regex scans, as the stdlib MIME parser finds them; the parser reads each header
    block, and the content is decoded (base64, quoted-printable) as it decodes it. A
    part without a Content-Type is text/plain; a nested multipart is not walked (it is
    no text). A body cut short keeps the parts that arrived."""
    boundary = _MIME.parsebytes(b"Content-Type: " + content_type + b"\r\n\r\n",
                                headersonly=True).get_boundary()
    if not boundary:
        return [], False
    out: list[tuple[str, bytes, str | None]] = []
    start = -1  # where the current part begins (after its delimiter line)
    stray = 0
    for m in _delimiter(boundary.encode("ascii", "surrogateescape")).finditer(body):
        at = m.start()
        if at and body[at - 1] not in b"\r\n":  # not at a line's start: content
            stray += 1
            if stray > limit:
                return out, True
            continue
        if start >= 0:
            out.append(_form_part(body[start:_chop_eol(body, start, at)]))
        if m.group(1) is not None:  # the close delimiter: the epilogue follows
            return out, False
        if len(out) >= limit:
            return out, True
        eol = _EOL.match(body, m.end())
        start = eol.end() if eol else m.end()
    if start >= 0:  # cut short
        out.append(_form_part(body[start:_chop_eol(body, start, len(body))]))
    return out, False


def _chop_eol(body: bytes, start: int, end: int) -> int:
    """`end` less the line end just before it (that of a delimiter line is its own)."""
    if end - start >= 2 and body[end - 2:end] == b"\r\n":
        return end - 2
    if end > start and body[end - 1] in b"\r\n":
        return end - 1
    return end


# A part's header block as the MIME parser reads one: lines starting with a field name
# and a colon (or "From "), or continuation lines; the empty line after them.
_PART_HEAD = re.compile(rb"(?:(?:From |[\x21-\x39\x3b-\x7e]*:|[\t ])[^\r\n]*"
                        rb"(?:\r\n|\r|\n|\Z))*(?:\r\n|\r|\n)?")


def _form_part(raw: bytes) -> tuple[str, bytes, str | None]:
    # Only the header block goes through the parser, which reads line by line in
    # Python: a part of many short lines (or a nested multipart) costs one regex match.
    end = _PART_HEAD.match(raw).end()
    part = _MIME.parsebytes(raw[:end], headersonly=True)
    media = part.get_content_type()
    if media.startswith("multipart/"):  # no text: left unread, as the parser leaves it
        return media, b"", None
    part.set_payload(raw[end:].decode("ascii", "surrogateescape"))
    return media, part.get_payload(decode=True) or b"", part.get_content_charset()


def part_text(data: bytes, charset: str | None) -> str:
    try:
        return data.decode(charset or "utf-8", "replace")
    except LookupError:  # an unknown charset
        return data.decode("utf-8", "replace")


def _multipart(content_type: bytes, json_fields, parts: list[str], meta: dict[str, Any],
               body: bytes) -> Modality:
    modality = TEXT
    found, cut = form_parts(content_type, body)
    meta["parts"] = len(found)
    if cut:  # more parts than MAX_FORM_PARTS: those past it are not read
        meta["parts_cut"] = True
    for media, data, charset in found:
        if is_json_type(media):
            _json_body(data, json_fields, parts, meta)
        elif media.startswith("text/"):
            parts.append(part_text(data, charset))
        elif modality == TEXT:
            sniffed = sniff_media(data, len(data))  # an uploaded image or audio file
            if sniffed is not None:
                meta.update(sniffed)
                modality = IMAGE if sniffed["kind"] == "image" else AUDIO
    return modality


def _extract_body(ctype: str, body: bytes, json_fields, parts: list[str],
                  meta: dict[str, Any], size: int, content_type: bytes = b"",
                  decoded_budget: int | None = None) -> Modality:
    if not body:
        return TEXT
    if ctype.startswith("application/grpc"):
        grpc_strings(body, parts, meta, decoded_budget=decoded_budget)
        return TEXT if parts else BINARY
    if is_json_type(ctype) or (not ctype and body[:1] in b"{["):
        _json_body(body, json_fields, parts, meta)
        return TEXT
    if ctype == "multipart/form-data":
        return _multipart(content_type, json_fields, parts, meta, body)
    if ctype in PROTOBUF_TYPES:
        protobuf_strings(body, parts)
        meta["protobuf"] = True
        return TEXT if parts else BINARY
    if ctype == "application/x-www-form-urlencoded":
        for _, value in parse_qsl(body.decode("utf-8", "replace")):
            if value:
                parts.append(value)
        return TEXT
    media = sniff_media(body, size)
    if media is not None:
        meta.update(media)
        return IMAGE if media["kind"] == "image" else AUDIO
    if ctype.startswith("text/") or ctype in ("", "application/x-ndjson"):
        text = body.decode("utf-8", "replace")
        parts.append(text)
        return TEXT
    if ctype == "application/octet-stream":
        found: list[str] = []
        if protobuf_strings(body, found) and found:
            parts.extend(found)
            meta["protobuf"] = True
            return TEXT
    return BINARY


# ---------------------------------------------------------------- JSON


def _json_body(body: bytes, json_fields, parts: list[str], meta: dict[str, Any]) -> None:
    try:
        doc = orjson.loads(body)  # a few times faster than json.loads
    except ValueError:
        try:  # what orjson refuses and json takes: NaN, integers past 64 bits, ...
            doc = wirejson.loads(body)
        except ValueError:
            meta["json"] = "partial"
            _lenient_json(body, json_fields, parts)
            return
    meta["json"] = "ok"
    if isinstance(doc, dict):
        _json_parts(doc, json_fields, parts, meta)


def _json_text(body: bytes, json_fields) -> str | None:
    """extract_text of a JSON body orjson parses; None: anything else (the full path
    decides, with the same result as before)."""
    try:
        doc = orjson.loads(body)
        parts: list[str] = []
        if isinstance(doc, dict):
            _json_parts(doc, json_fields, parts, None)
    except Exception:
        return None
    return _joined(parts)


def _json_parts(doc: dict, json_fields, parts: list[str], meta: dict[str, Any] | None) -> None:
    """The text fields of a parsed JSON object into parts; metadata into meta if given."""
    if meta is not None:
        model = doc.get("model")
        if isinstance(model, str):
            meta["model"] = model
    messages = doc.get("messages")
    if isinstance(messages, list):
        _messages(messages, parts, meta)
    prompt = doc.get("prompt")
    if prompt is not None:
        _strings(prompt, parts)
    inp = doc.get("input")
    if isinstance(inp, list) and inp and isinstance(inp[0], dict):
        _messages(inp, parts, meta)
    elif inp is not None:
        _strings(inp, parts)
    for path in json_fields:
        value: Any = doc
        for key in path.split("."):
            if isinstance(value, dict):
                value = value.get(key)
            elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
                value = value[int(key)]
            else:
                value = None
                break
        if value is not None:
            _strings(value, parts)


def _strings(value: Any, parts: list[str]) -> None:
    if isinstance(value, str):
        parts.append(value)
    elif isinstance(value, list):
        for item in value[:MAX_TEXT_PARTS]:
            if isinstance(item, str):
                parts.append(item)


def _messages(messages: list, parts: list[str], meta: dict[str, Any] | None) -> None:
    """User turns' text (all turns when there is no user turn); counts media parts
    (into meta, when given)."""
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    chosen = users or [m for m in messages if isinstance(m, dict)]
    if meta is not None:
        meta["messages"] = len(messages)
    for msg in chosen[-MAX_TEXT_PARTS:]:
        content = msg.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    continue
                kind = part.get("type")
                if kind in ("text", "input_text") and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif meta is None:
                    continue
                elif kind in ("image_url", "input_image", "image"):
                    meta["images"] = meta.get("images", 0) + 1
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    if isinstance(url, str) and url.startswith("data:") and "image_meta" not in meta:
                        media = _data_url(url)
                        if media:
                            meta["image_meta"] = media
                elif kind in ("input_audio", "audio"):
                    meta["audio_parts"] = meta.get("audio_parts", 0) + 1
                    data = part.get("input_audio")
                    data = data.get("data") if isinstance(data, dict) else None
                    if isinstance(data, str) and "audio_meta" not in meta:
                        media = _b64_media(data)
                        if media:
                            meta["audio_meta"] = media


def _data_url(url: str) -> dict[str, Any] | None:
    head, _, data = url.partition(",")
    if ";base64" not in head:
        return None
    return _b64_media(data)


def _b64_media(data: str) -> dict[str, Any] | None:
    chunk = data[:65536]
    chunk = chunk[: len(chunk) - len(chunk) % 4]
    try:
        raw = base64.b64decode(chunk, validate=False)
    except (binascii.Error, ValueError):
        return None
    return sniff_media(raw, None)


@lru_cache(maxsize=64)
def _lenient_pattern(fields: tuple[str, ...]) -> re.Pattern[bytes]:
    keys = ["content", "prompt", "input", "text"] + [f.rsplit(".", 1)[-1] for f in fields]
    alt = b"|".join(re.escape(k.encode()) for k in dict.fromkeys(keys))
    return re.compile(rb'"(?:' + alt + rb')"\s*:\s*"((?:[^"\\]|\\.)*)("?)')


def _lenient_json(body: bytes, json_fields, parts: list[str]) -> None:
    """String values of the interesting keys in a JSON document that was cut short."""
    for m in _lenient_pattern(tuple(json_fields)).finditer(body):
        raw = m.group(1)
        if not m.group(2):  # unterminated: drop a dangling escape
            raw = re.sub(rb"\\(u[0-9a-fA-F]{0,3})?$", b"", raw)
        try:
            parts.append(json.loads(b'"' + raw + b'"'))
        except ValueError:
            parts.append(raw.decode("utf-8", "replace"))
        if len(parts) >= MAX_TEXT_PARTS:
            break


# ---------------------------------------------------------------- gRPC / protobuf


MAX_GRPC_DECODED = 1 << 20  # what one compressed gRPC message may expand to here


def _grpc_inflate(payload: bytes, most: int = MAX_GRPC_DECODED) -> bytes | None:
    """A compressed gRPC message decoded, when its coding is gzip or deflate (zlib), the
    two every gRPC implementation offers (told apart by their headers, as the
    grpc-encoding field says the same); at most `most` bytes of it, and what
    arrived of one cut short by the inspect limit. None: another coding (snappy, zstd)
    or not compressed data."""
    if payload[:2] == b"\x1f\x8b":
        wbits = 31
    elif len(payload) >= 2 and payload[0] & 0x0F == 8 and (payload[0] << 8 | payload[1]) % 31 == 0:
        wbits = 15
    else:
        return None
    try:
        return zlib.decompressobj(wbits).decompress(payload, most)
    except zlib.error:
        return None


def grpc_strings(body: bytes, parts: list[str], meta: dict[str, Any] | None = None,
                 limit: int | None = MAX_TEXT_PARTS, decoded_budget: int | None = None) -> None:
    """The text fields of length-prefixed gRPC messages (1 byte compressed flag + 4
    bytes big-endian length), at most `limit` per message (None: all). A compressed
    message (gzip or deflate) is read decoded: a client that compresses gets the route
    the same message gets uncompressed. `decoded_budget`: the message bytes read in all,
    framing apart and compressed ones counted decoded, as the same messages uncompressed
    would be cut at it (None: each compressed message to MAX_GRPC_DECODED). A few KiB
    of compressed frames decode to a MiB each, and reading that would cost the event
    loop seconds. meta["grpc_cut"]: the budget (or MAX_GRPC_DECODED) left bytes unread."""
    if meta is None:
        meta = {}
    i, n, frames = 0, len(body), 0
    while i + 5 <= n:
        flag = body[i]
        length = int.from_bytes(body[i + 1:i + 5], "big")
        payload = body[i + 5:i + 5 + length]
        frames += 1
        if decoded_budget is not None and decoded_budget <= 0:
            meta["grpc_cut"] = True  # messages left unread
            break
        if flag & 1:
            meta["grpc_compressed"] = True
            most = (MAX_GRPC_DECODED if decoded_budget is None
                    else min(decoded_budget, MAX_GRPC_DECODED))
            payload = _grpc_inflate(payload, most)
            if payload is not None and len(payload) >= most:
                meta["grpc_cut"] = True  # (or it ends just there: either way, read no more)
        elif decoded_budget is not None and len(payload) > decoded_budget:
            payload = payload[:decoded_budget]
            meta["grpc_cut"] = True
        if payload:
            if decoded_budget is not None:
                decoded_budget -= len(payload)
            protobuf_strings(payload, parts, limit=limit)
        i += 5 + length
    meta["grpc_frames"] = frames


def _varint(buf: bytes, i: int, n: int) -> tuple[int, int]:
    result = shift = 0
    while i < n and shift < 64:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7
    return -1, i


_KEEP_WS = {9: None, 10: None, 13: None}


def _texty(payload: bytes) -> str | None:
    try:
        s = payload.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not s or not s.translate(_KEEP_WS).isprintable():
        return None
    return s


def protobuf_strings(buf: bytes, out: list[str], depth: int = 0,
                     limit: int | None = MAX_TEXT_PARTS) -> bool:
    """Append the text fields of a protobuf message (no schema) to `out`, at most `limit`
    (None: all). Returns whether `buf` parsed as a well-formed message (a cut-off last
    field counts as well-formed)."""
    i, n = 0, len(buf)
    found: list[str] = []
    ok = True
    while i < n:
        key, i = _varint(buf, i, n)
        if key <= 0 or key >> 3 == 0:
            ok = False
            break
        wt = key & 7
        if wt == 0:
            v, i = _varint(buf, i, n)
            if v < 0:
                break  # cut off
        elif wt == 1:
            i += 8
        elif wt == 5:
            i += 4
        elif wt == 2:
            length, i = _varint(buf, i, n)
            if length < 0:
                break
            payload = buf[i:i + length]
            cut = i + length > n
            i += length
            text = _texty(payload)
            if text is None and cut:
                try:  # a string cut mid-character by the inspect limit
                    text = payload.decode("utf-8", "ignore") or None
                except UnicodeDecodeError:  # pragma: no cover
                    text = None
                if text is not None and not _texty(text.encode()):
                    text = None
            if text is not None:
                found.append(text)
            elif depth < MAX_PB_DEPTH and payload:
                nested: list[str] = []
                if protobuf_strings(payload, nested, depth + 1, limit):
                    found.extend(nested)
        elif wt in (3, 4):
            continue  # group start/end: fields inside are walked as if flat
        else:
            ok = False
            break
        if limit is not None and len(found) >= limit:
            break
    if ok or depth == 0:
        out.extend(found)
    return ok


# ---------------------------------------------------------------- images and audio


def sniff_media(buf: bytes, size: int | None) -> dict[str, Any] | None:
    """Image or audio metadata from the first bytes of a file, or None."""
    try:
        return _sniff(buf, size)
    except (struct.error, IndexError, ValueError, ZeroDivisionError):
        return None


def _sniff(b: bytes, size: int | None) -> dict[str, Any] | None:
    n = len(b)
    if b[:8] == b"\x89PNG\r\n\x1a\n":
        meta = {"kind": "image", "format": "png"}
        if n >= 24 and b[12:16] == b"IHDR":
            meta["width"], meta["height"] = _unpack_from(">II", b, 16)
        return meta
    if b[:6] in (b"GIF87a", b"GIF89a"):
        meta = {"kind": "image", "format": "gif"}
        if n >= 10:
            meta["width"], meta["height"] = _unpack_from("<HH", b, 6)
        return meta
    if b[:3] == b"\xff\xd8\xff":
        meta = {"kind": "image", "format": "jpeg"}
        wh = _jpeg_size(b)
        if wh:
            meta["width"], meta["height"] = wh
        return meta
    if b[:4] == b"RIFF" and b[8:12] == b"WEBP":
        meta = {"kind": "image", "format": "webp"}
        wh = _webp_size(b)
        if wh:
            meta["width"], meta["height"] = wh
        return meta
    if b[:4] == b"RIFF" and b[8:12] == b"WAVE":
        return _wav(b)
    if b[:4] == b"fLaC":
        return _flac(b)
    if b[:4] == b"OggS":
        return _ogg(b, size)
    if b[:3] == b"ID3" or (n >= 2 and b[0] == 0xFF and (b[1] & 0xE0) == 0xE0):
        return _mp3(b, size)
    return None


_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg_size(b: bytes) -> tuple[int, int] | None:
    i, n = 2, len(b)
    while i + 4 <= n:
        if b[i] != 0xFF:
            return None
        marker = b[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        (length,) = _unpack_from(">H", b, i + 2)
        if marker in _SOF:
            if i + 9 > n:
                return None
            h, w = _unpack_from(">HH", b, i + 5)
            return w, h
        if marker == 0xDA or length < 2:  # start of scan before any SOF
            return None
        i += 2 + length
    return None


def _webp_size(b: bytes) -> tuple[int, int] | None:
    chunk = b[12:16]
    if chunk == b"VP8 " and len(b) >= 30 and b[23:26] == b"\x9d\x01\x2a":
        w, h = _unpack_from("<HH", b, 26)
        return w & 0x3FFF, h & 0x3FFF
    if chunk == b"VP8L" and len(b) >= 25 and b[20] == 0x2F:
        (bits,) = _unpack_from("<I", b, 21)
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X" and len(b) >= 30:
        w = int.from_bytes(b[24:27], "little") + 1
        h = int.from_bytes(b[27:30], "little") + 1
        return w, h
    return None


def _wav(b: bytes) -> dict[str, Any]:
    meta: dict[str, Any] = {"kind": "audio", "format": "wav"}
    i, n = 12, len(b)
    byte_rate = 0
    while i + 8 <= n:
        cid = b[i:i + 4]
        (clen,) = _unpack_from("<I", b, i + 4)
        if cid == b"fmt " and i + 24 <= n:
            fmt, ch, sr, byte_rate, _align, bits = _unpack_from("<HHIIHH", b, i + 8)
            meta.update(codec=fmt, channels=ch, sample_rate=sr, bits_per_sample=bits)
        elif cid == b"data":
            if byte_rate and clen not in (0, 0xFFFFFFFF):
                meta["duration"] = round(clen / byte_rate, 6)
            break
        i += 8 + clen + (clen & 1)
    return meta


def _flac(b: bytes) -> dict[str, Any]:
    meta: dict[str, Any] = {"kind": "audio", "format": "flac"}
    # first metadata block must be STREAMINFO (type 0, 34 bytes) right after "fLaC"
    if len(b) >= 8 + 18 and (b[4] & 0x7F) == 0:
        (packed,) = _unpack_from(">Q", b, 18)
        sr = packed >> 44
        ch = ((packed >> 41) & 0x7) + 1
        bps = ((packed >> 36) & 0x1F) + 1
        total = packed & 0xFFFFFFFFF
        meta.update(sample_rate=sr, channels=ch, bits_per_sample=bps)
        if sr and total:
            meta["duration"] = round(total / sr, 6)
    return meta


def _ogg(b: bytes, size: int | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"kind": "audio", "format": "ogg"}
    if len(b) < 27:
        return meta
    nseg = b[26]
    data = 27 + nseg
    rate = 0
    preskip = 0
    if b[data:data + 7] == b"\x01vorbis" and len(b) >= data + 16:
        ch = b[data + 11]
        (rate,) = _unpack_from("<I", b, data + 12)
        meta.update(codec="vorbis", channels=ch, sample_rate=rate)
    elif b[data:data + 8] == b"OpusHead" and len(b) >= data + 16:
        ch = b[data + 9]
        (preskip, in_rate) = _unpack_from("<HI", b, data + 10)
        rate = 48000  # Opus granule positions count 48 kHz samples
        meta.update(codec="opus", channels=ch, sample_rate=in_rate or 48000)
    if rate and (size is None or size <= len(b)):
        last = b.rfind(b"OggS")
        if last >= 0 and last + 14 <= len(b):
            (granule,) = _unpack_from("<q", b, last + 6)
            if granule > 0:
                meta["duration"] = round(max(0, granule - preskip) / rate, 6)
    return meta


_MP3_BITRATES = {
    (1, 1): (0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (1, 2): (0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (1, 3): (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (2, 1): (0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (2, 2): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_MP3_BITRATES[(2, 3)] = _MP3_BITRATES[(2, 2)]
_MP3_RATES = {1: (44100, 48000, 32000), 2: (22050, 24000, 16000), 25: (11025, 12000, 8000)}


def _mp3(b: bytes, size: int | None) -> dict[str, Any] | None:
    i, n = 0, len(b)
    if b[:3] == b"ID3" and n >= 10:
        tag = (b[6] & 0x7F) << 21 | (b[7] & 0x7F) << 14 | (b[8] & 0x7F) << 7 | (b[9] & 0x7F)
        i = 10 + tag + (10 if b[5] & 0x10 else 0)
    meta: dict[str, Any] = {"kind": "audio", "format": "mp3"}
    # find the first frame header
    limit = min(n - 4, i + 4096)
    while i <= limit:
        if b[i] == 0xFF and (b[i + 1] & 0xE0) == 0xE0:
            (hdr,) = _unpack_from(">I", b, i)
            ver_bits = (hdr >> 19) & 3
            layer_bits = (hdr >> 17) & 3
            br_idx = (hdr >> 12) & 0xF
            sr_idx = (hdr >> 10) & 3
            if ver_bits != 1 and layer_bits != 0 and br_idx not in (0, 15) and sr_idx != 3:
                version = {3: 1, 2: 2, 0: 25}[ver_bits]
                layer = 4 - layer_bits
                sr = _MP3_RATES[version][sr_idx]
                kbps = _MP3_BITRATES[(1 if version == 1 else 2, layer)][br_idx]
                channels = 1 if ((hdr >> 6) & 3) == 3 else 2
                meta.update(sample_rate=sr, channels=channels, bitrate_kbps=kbps, layer=layer)
                spf = 1152 if layer != 1 else 384
                if version != 1 and layer == 3:
                    spf = 576
                frames = _xing_frames(b, i, version, channels)
                if frames:
                    meta["duration"] = round(frames * spf / sr, 6)
                elif kbps:
                    total = size if size is not None else n
                    meta["duration"] = round(max(0, total - i) * 8 / (kbps * 1000), 3)
                    meta["duration_estimated"] = True
                return meta
        i += 1
    return meta if b[:3] == b"ID3" else None


def _xing_frames(b: bytes, i: int, version: int, channels: int) -> int | None:
    side = (32 if channels == 2 else 17) if version == 1 else (17 if channels == 2 else 9)
    off = i + 4 + side
    if b[off:off + 4] in (b"Xing", b"Info") and off + 12 <= len(b):
        (flags,) = _unpack_from(">I", b, off + 4)
        if flags & 1:
            return _unpack_from(">I", b, off + 8)[0]
    return None
