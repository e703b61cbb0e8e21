"""Guardrails: a prompt guard over the request's text and redaction of the response.

Prompt guard (`[[guard.rules]]`): keywords (case-insensitive substrings, all rules' in
one Aho-Corasick automaton) and regexes over the request's text: for a JSON body
(whatever its content type) every string in it (all messages and roles, system
prompts, instructions, tool definitions and call arguments: whatever the model may
read, object keys too; each value of a duplicate name); for a multipart/form-data body
its text parts (fields, text/* and JSON files, decoded if sent base64 or
quoted-printable; other files are skipped; a body of more than MAX_FORM_PARTS parts is
refused, 413 too_many_parts); otherwise the
UnifiedRequest text the semantic layer extracts (gRPC strings, form values, plain text,
...). A body longer than inspect_bytes is refused (413 guard_body_too_large); of a gRPC
call the first message is read. The body is read in each way an upstream may decode
it (readings: as sent, as its charset says, JSON in UTF-16 or UTF-32); a charset the
guard cannot decode is refused (415 unsupported_charset). Keywords match the text as a
reader sees it: compatibility-normalized (NFKC: fullwidth letters are letters), without
invisible (default-ignorable) characters, with each run of whitespace one space; regexes
match both the text as sent and the text NFKC-normalized without invisible characters.
A `block` rule answers 403 with its id; a `flag` rule lets the request through with
x-aiproxy-guard-flags on the upstream request and the response, and in the audit record.

Redaction (`[redact]`): see aiproxy/governance/redact.py. The upstream is asked for an
uncompressed response (Accept-Encoding: identity) so the text can be read. A response
that comes gzip/deflate-compressed anyway is decompressed, redacted and sent
uncompressed (counted as "decoded"); one in a coding that cannot be decoded here (br,
zstd, ...) never reaches the client: 502 `redaction_failed` (counted as "refused").
"""

from __future__ import annotations

import json
import logging
import re
import unicodedata
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

import ahocorasick
import orjson

from aiproxy.config.governance import GuardConfig, RedactConfig
from aiproxy.config.safe_regex import compile_text, text_bytes
from aiproxy.governance.decoding import Decoder, decoder_for
from aiproxy.governance.redact import INVISIBLE, Redactor, compile_detector
from aiproxy.llm.openai import body_model
from aiproxy.pipeline.filters import (
    Filter,
    FilterFactory,
    LocalReply,
    ResponseHead,
    ResponseRefused,
)
from aiproxy.protocols.fields import F_CONTENT_LENGTH, F_HOP
from aiproxy.semantic.unified import (
    MAX_FORM_PARTS,
    PROTOBUF_TYPES,
    extract,
    form_parts,
    grpc_strings,
    is_json_type,
    media_type,
    protobuf_strings,
)
from aiproxy.wirejson import valid_text

if TYPE_CHECKING:
    from aiproxy.config import Config, RouteConfig
    from aiproxy.pipeline.exchange import Exchange

log = logging.getLogger("aiproxy.guard")

FLAGS_HEADER = b"x-aiproxy-guard-flags"
# Token streams: content values are read as running texts across events (SSE, whose
# plain-text data: lines are text) or lines (NDJSON, as Ollama streams; JSON Lines).
STREAMED_JSON = frozenset(("text/event-stream", "application/x-ndjson", "application/jsonl"))


_SPACES = re.compile(r"\s+")
_LEADING_WS = re.compile(rb"[ \t\r\n]*")
_LEADING_SPACE = re.compile(r"[ \t\r\n]*")
# Each charset parameter of a Content-Type (readers differ on which of two counts).
_CHARSET = re.compile(rb';[ \t]*charset[ \t]*=[ \t]*"?([^";, \t]*)', re.IGNORECASE)
# An escape in a JSON string: \uXXXX, JSON5's \xXX, or a character.
_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|x([0-9a-fA-F]{2})|(.))", re.DOTALL)
_ESCAPED = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "0": "\0"}
# Each string of a (valid) JSON text; group 1 is set for a key.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"([ \t\r\n]*:)?')
# Each string of a loosely read document: double-quoted or JSON5's single-quoted, read
# from left to right (a quote inside the other kind of string starts none).
_LOOSE_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"' rb"|'[^'\\]*(?:\\.[^'\\]*)*'",
                           re.DOTALL)


def json_text(body: bytes) -> str | None:
    """Every string of a JSON body, keys and values, one per line (None: not JSON); a
    body cut at the inspection limit is not JSON and is read as text instead. Every
    value of a duplicate key is read: parsers differ on which one they keep."""
    start = _LEADING_WS.match(body).end()
    if body[start:start + 1] not in (b"{", b"["):
        return None
    try:
        doc = orjson.loads(body)
    except ValueError:
        # What orjson refuses and Python's json (so many an upstream) takes: NaN,
        # Infinity, integers past 64 bits. Not JSON to either: None (read loosely).
        try:
            return json_text_pairs(body)
        except (ValueError, RecursionError):
            return None
    out, keys = _strings_in(doc)
    ends = _STRING.findall(body)
    if keys < len(ends) - ends.count(b""):
        # A duplicate key, whose other values orjson dropped: read them all.
        try:
            return json_text_pairs(body)
        except RecursionError:  # nested deeper than Python's json goes: read loosely
            return None
    return "\n".join(out)


def json_text_pairs(body: bytes) -> str:
    """json_text of a (valid) body read with every (key, value) pair kept."""
    doc = json.loads(body, object_pairs_hook=lambda pairs: [x for pair in pairs for x in pair])
    return "\n".join(_strings_in(doc)[0])


def _strings_in(doc: Any) -> tuple[list[str], int]:
    """Every string of a parsed JSON document, keys and values, in document order, and
    how many object members it has. Keys are read: a model reads them too (a tool's
    parameter names, a response_format schema's property names)."""
    out: list[str] = []
    keys = 0
    stack = [doc]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, dict):
            keys += len(value)
            stack.extend(reversed([x for pair in value.items() for x in pair]))
        elif isinstance(value, list):
            stack.extend(reversed(value))
    return out, keys


def multipart_text(content_type: bytes, body: bytes) -> tuple[str, bool]:
    """The text of a multipart/form-data body's text parts (no Content-Type, text/* or
    JSON: every string), one per line, in each reading of a part; file parts of other
    types are skipped. And whether parts were left unread (more than MAX_FORM_PARTS:
    see form_parts). UnknownCharset: see readings."""
    out = []
    found, cut = form_parts(content_type, body)
    for media, data, charset in found:
        if not (is_json_type(media) or media.startswith("text/")):
            continue
        for reading in readings(media, [charset] if charset else [], data):
            text = json_text(reading) if is_json_type(media) else None
            out.append(text if text is not None else reading.decode("utf-8", "replace"))
    return "\n".join(out), cut


class UnknownCharset(ValueError):
    """A charset parameter that names no text encoding the guard can decode."""


def readings(media: str, charsets: list[str], body: bytes) -> list[bytes]:
    """The body as each upstream may decode it, in UTF-8 but for the bytes as sent
    (first): as each charset parameter of a text or JSON type says (aiohttp's text()
    and json() honour it; most JSON readers do not), and a JSON text in UTF-16 or
    UTF-32 or after a BOM, which RFC 8259 8.1 lets a reader take (Python's json.loads
    does: json.detect_encoding). The guard reads all of them: any one could be what the
    model is given. UnknownCharset for a charset it cannot decode: not passed unread."""
    out = [body]
    if media.startswith("text/") or is_json_type(media):
        for name in charsets:
            try:
                out.append(body.decode(name, "replace").encode("utf-8", "replace"))
            except (LookupError, UnicodeError):  # unknown; not a text codec; idna, ...
                raise UnknownCharset(name) from None
    encoding = json.detect_encoding(body)
    if encoding != "utf-8":
        text = body.decode(encoding, "replace")
        if text[_LEADING_SPACE.match(text).end():][:1] in ("{", "["):
            out.append(text.encode("utf-8", "replace"))
    return list(dict.fromkeys(out))


def loose_json_text(body: bytes) -> str:
    """A document that looks like JSON but no strict parser takes (a trailing comma, a
    comment, single quotes: what lenient parsers read): the body as text, and each of
    its strings, double- or single-quoted (JSON5), keys too, decoded (escapes would hide a keyword in the
    raw text): bytes that are not UTF-8 replaced, not the string skipped, and an escape
    JSON does not have read as lenient parsers read it (JSON5's \\x41; \\q is q)."""
    out = [body.decode("utf-8", "replace")]
    for m in _LOOSE_STRING.finditer(body):
        literal = m.group(0)
        if b"\\" in literal:
            text = _ESCAPE.sub(_unescaped, literal[1:-1].decode("utf-8", "replace"))
            out.append(valid_text(text))  # surrogate pairs joined, lone ones U+FFFD
    return "\n".join(out)


def _unescaped(m: re.Match[str]) -> str:
    code = m.group(1) or m.group(2)
    return chr(int(code, 16)) if code else _ESCAPED.get(m.group(3), m.group(3))


def pairs_text(data: bytes) -> str:
    """Every name and value of application/x-www-form-urlencoded data (a body or a
    query string), one per line; all of them, where routing reads a few hundred."""
    out = []
    for name, value in parse_qsl(data.decode("utf-8", "replace"), keep_blank_values=True):
        out.append(name)
        if value:
            out.append(value)
    return "\n".join(out)


def body_text(content_type: bytes, body: bytes, json_fields: tuple[str, ...],
              size: int | None, inspect_bytes: int | None = None) -> tuple[str, str | None]:
    """Every piece of the body an upstream may read as text, one per line, in each way
    it may decode the body (readings), and why parts were left unread (None: all read):
    a multipart body of more than MAX_FORM_PARTS parts, or compressed gRPC messages
    that decode past inspect_bytes in all. UnknownCharset: see readings."""
    media = media_type(content_type)
    charsets = [c.decode("latin-1") for c in _CHARSET.findall(content_type)]
    texts = []
    for data in readings(media, charsets, body):
        text, unread = _reading_text(content_type, media, data, json_fields, size,
                                     inspect_bytes)
        if unread is not None:
            return text, unread
        texts.append(text)
    return "\n".join(filter(None, texts)), None


def _reading_text(content_type: bytes, media: str, body: bytes, json_fields: tuple[str, ...],
                  size: int | None, inspect_bytes: int | None) -> tuple[str, str | None]:
    """body_text of one reading of the body (UTF-8, or bytes as sent)."""
    text = json_text(body)
    if text is not None:
        return text, None
    if media == "multipart/form-data":
        text, cut = multipart_text(content_type, body)
        return text, (f"a multipart body the guard reads may have at most {MAX_FORM_PARTS} "
                      "parts" if cut else None)
    start = _LEADING_WS.match(body).end()
    if body[start:start + 1] in (b"{", b"[") or is_json_type(media):
        return loose_json_text(body), None
    if media == "application/x-www-form-urlencoded":
        return pairs_text(body), None
    grpc = media.startswith("application/grpc")
    octets = media == "application/octet-stream"
    if grpc or octets or media in PROTOBUF_TYPES:
        found: list[str] = []
        if grpc:
            # Decoded, compressed messages count as the same uncompressed ones would: a
            # few KiB of them can decode to a MiB each (seconds of the event loop).
            meta: dict[str, Any] = {}
            grpc_strings(body, found, meta, limit=None, decoded_budget=inspect_bytes)
            if meta.get("grpc_cut"):
                return "", (f"the prompt guard reads at most {inspect_bytes} bytes of "
                            "gRPC messages, decoded ([guard] inspect_bytes)")
        else:  # octet-stream: what parses as protobuf is read as the router reads it
            protobuf_strings(body, found, limit=None)
        if found or not octets:
            return "\n".join(found), None
    text = extract(content_type, body, b"", json_fields, body_size=size).text
    if not text and body:
        # A type this reader does not know (XML, YAML, ...) that is text all the same.
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            pass
    return text, None


def visible_nfkc(text: str) -> str:
    """The text NFKC-normalized without invisible characters (ASCII text is that
    already, and comes back as it is)."""
    if text.isascii():
        return text
    return unicodedata.normalize("NFKC", text).translate(INVISIBLE)


def reader_text(text: str) -> str:
    """The text as a reader sees it, for keywords: NFKC, no zero-width characters, each
    run of whitespace one space, case-folded."""
    return _keyword_text(visible_nfkc(text))


def _keyword_text(norm: str) -> str:
    return _SPACES.sub(" ", norm).casefold()


class PromptGuard:
    def __init__(self, cfg: GuardConfig) -> None:
        self.actions = {r.id: r.action for r in cfg.rules}
        self.automaton: Any = None
        words = [(reader_text(kw), r.id) for r in cfg.rules for kw in r.keywords]
        if words:
            auto = ahocorasick.Automaton()
            for word, rid in words:
                ids = auto.get(word, ())
                auto.add_word(word, (*ids, rid))
            auto.make_automaton()
            self.automaton = auto
        # One pattern per regex, not one alternation of all: joined, patterns lose their
        # own flags and group numbers (and may not compile), and a match of one rule
        # would hide an overlapping match of another.
        # RE2 (linear time), never `re`: they run over the client's text on the event loop.
        self.patterns = [(r.id, compile_text(rx)) for r in cfg.rules for rx in r.regexes]

    def scan(self, text: str) -> list[str]:
        """Ids of the rules the text hits: keyword rules in the order the text hits them,
        then regex rules in config order."""
        hits: dict[str, None] = {}
        norm = visible_nfkc(text)  # once, for keywords and regexes both
        if self.automaton is not None:
            for _, ids in self.automaton.iter(_keyword_text(norm)):
                for rid in ids:
                    hits[rid] = None
        if self.patterns:
            # Each regex sees the text as sent (a pattern may be written for look-alikes
            # or fullwidth forms) and as a reader sees it (fullwidth "ＡＫＩＡ" is "AKIA").
            datas = [text_bytes(text)] if norm == text else [text_bytes(text),
                                                            text_bytes(norm)]
            for rid, pattern in self.patterns:
                if rid not in hits and any(pattern.search(d) for d in datas):
                    hits[rid] = None
        return list(hits)


class GuardFilter(Filter):
    __slots__ = ("guard", "inspect_bytes", "flags", "redactor", "decoder", "detector",
                 "json_fields", "counts")

    def __init__(self, guard: PromptGuard | None, detector: Any, json_fields: tuple,
                 counts: dict[tuple[str, str], int], inspect_bytes: int = 0) -> None:
        self.guard = guard
        self.inspect_bytes = inspect_bytes
        self.detector = detector
        self.json_fields = json_fields
        self.counts = counts
        self.flags: list[str] = []
        self.redactor: Redactor | None = None
        self.decoder: Decoder | None = None

    def request(self, ex: Exchange) -> LocalReply | None:
        if self.guard is None:
            return None
        head = ex.head
        body = ex.request_body()
        whole = ex.request_body_whole(body)
        if not ex.grpc and (not whole or len(body) > self.inspect_bytes):
            # What it did not read would go upstream unread: refused, as a coded body is
            # (and so is any body over the limit, whether or not it all came in one read).
            # A gRPC call is read up to its first message: a stream is not held.
            return LocalReply(413, "guard_body_too_large", "the prompt guard reads at most "
                              f"{self.inspect_bytes} bytes of a request body "
                              "([guard] inspect_bytes)")
        if ex.grpc and not whole and 5 <= len(body) < 5 + int.from_bytes(body[1:5], "big"):
            # Held at inspect_bytes before its first message was whole: read, that part
            # would fit the budget and the rest of the message go upstream unread.
            return LocalReply(413, "guard_body_too_large", "the prompt guard reads a gRPC "
                              f"call's first message whole, at most {self.inspect_bytes} "
                              "bytes ([guard] inspect_bytes)")
        size = head.content_length if head.content_length >= 0 else None
        try:
            text, unread = body_text(head.get(b"content-type") or b"", body,
                                     self.json_fields, size, self.inspect_bytes)
        except UnknownCharset as exc:
            return LocalReply(415, "unsupported_charset", "the prompt guard cannot decode "
                              f"charset {str(exc)[:64]!r}")
        if unread is not None:
            # What it did not read could hold a prompt: refused, as a body in a
            # Content-Encoding is, not passed unread.
            return LocalReply(413, "guard_body_too_large" if ex.grpc else "too_many_parts",
                              unread)
        q = ex.up_target.find(b"?")
        if q >= 0:
            text = "\n".join(filter(None, (text, pairs_text(ex.up_target[q + 1:]))))
        if not text:
            return None
        hits = self.guard.scan(text)
        if not hits:
            return None
        actions = self.guard.actions
        blocked = [h for h in hits if actions[h] == "block"]
        counts = self.counts
        for h in hits:
            key = ("guard", f"{h}:{actions[h]}")
            counts[key] = counts.get(key, 0) + 1
        ex.gov["guard"] = {"hits": hits, "blocked": blocked[0] if blocked else None}
        if blocked:
            # The LLM filter, which names the model for the audit record, never sees it.
            if ex.gov.get("model") is None:
                ex.gov["model"] = body_model(body)
            return LocalReply(403, "guard_blocked", f"blocked by guard rule {blocked[0]}",
                              [(b"x-aiproxy-guard", blocked[0].encode("latin-1"))])
        self.flags = hits
        ex.set_upstream_header(FLAGS_HEADER, ",".join(hits).encode("latin-1"))
        return None

    def response_head(self, ex: Exchange, resp: Any) -> Any:
        if self.detector is not None:
            resp = self._start_redaction(ex, resp)
        if self.flags:
            resp = ResponseHead.derived(
                resp, extra=((FLAGS_HEADER, ",".join(self.flags).encode("latin-1")),))
        return resp

    def _count(self, kind: str) -> None:
        self.counts[("redact", kind)] = self.counts.get(("redact", kind), 0) + 1

    def _start_redaction(self, ex: Exchange, resp: Any) -> Any:
        detector, ctypes = self.detector
        ctype = (resp.get(b"content-type") or b"").split(b";", 1)[0].strip().lower().decode(
            "latin-1")
        if ctype not in ctypes and not (ctype.endswith("+json") and "application/json" in
                                        ctypes):
            return resp
        encoding = b",".join(resp.get_all(b"content-encoding")).strip().lower()
        if encoding and encoding != b"identity":
            decoder = decoder_for(encoding)
            if decoder is None:
                # Fail closed: what cannot be read cannot be redacted.
                ex.gov["redactions"] = {"refused": 1}
                self._count("refused")
                raise ResponseRefused(LocalReply(
                    502, "redaction_failed", "the upstream response is in a content coding "
                    f"that cannot be redacted: {encoding.decode('latin-1')}"))
            self.decoder = decoder
            self._count("decoded")
            resp = _decoded_head(resp)
        mode = ("auto" if ctype == "" else
                "sse" if ctype == "text/event-stream" else
                "ndjson" if ctype in STREAMED_JSON else
                "json" if "json" in ctype else "text")
        self.redactor = Redactor(detector, mode)
        return resp

    def response_body(self, ex: Exchange, data: bytes) -> bytes:
        r = self.redactor
        if r is None:
            return data
        if self.decoder is not None:
            data = self.decoder.feed(data)  # DecodeError ends the response
        return r.feed(data)

    def response_end(self, ex: Exchange) -> bytes:
        r = self.redactor
        if r is None:
            return b""
        tail = r.feed(self.decoder.end()) if self.decoder is not None else b""
        tail += r.end()
        if r.counts:
            ex.gov["redactions"] = dict(r.counts)
            counts = self.counts
            for kind, n in r.counts.items():
                counts[("redact", kind)] = counts.get(("redact", kind), 0) + n
        return tail


def _decoded_head(resp: Any) -> ResponseHead:
    """The head of a response sent decoded: no Content-Encoding, no Content-Length (the
    length changes), no Accept-Ranges (ranges of the encoded form), ETag weakened (a
    different representation), as nginx's gunzip does."""
    fields = []
    for name, value in resp.fields(F_HOP | F_CONTENT_LENGTH):  # see ResponseHead.derived
        if name in (b"content-encoding", b"accept-ranges"):
            continue
        if name == b"etag" and not value.startswith(b"W/"):
            value = b"W/" + value
        fields.append((name, value))
    return ResponseHead(resp.status, fields)


class GuardFactory(FilterFactory):
    name = "guard"

    def __init__(self, config: Config, counts: dict[tuple[str, str], int]) -> None:
        self.counts = counts  # ("guard", "rule:action") / ("redact", type) -> count
        self.guard = PromptGuard(config.guard) if config.guard is not None and \
            config.guard.rules else None
        self.inspect_bytes = config.guard.inspect_bytes if self.guard is not None else 0
        redact: RedactConfig | None = config.redact
        self.detector = ((compile_detector(redact.types), redact.content_types)
                         if redact is not None and redact.types else None)
        self.json_fields = config.semantic.json_fields if config.semantic is not None else ()

    def start(self, ex: Exchange) -> Filter:
        if self.detector is not None:
            ex.set_upstream_header(b"accept-encoding", b"identity")
        return GuardFilter(self.guard, self.detector, self.json_fields, self.counts,
                           self.inspect_bytes)

    def metric_families(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        hits = CounterMetricFamily("aiproxy_guard_hits", "Prompt guard rule hits",
                                   labels=["rule", "action"])
        masked = CounterMetricFamily("aiproxy_redactions",
                                     "Values masked in responses, by type (decoded: "
                                     "compressed responses decompressed to be redacted; "
                                     "refused: 502 for a coding that cannot be)",
                                     labels=["type"])
        for (what, key), n in sorted(self.counts.items()):
            if what == "guard":
                hits.add_metric(key.rsplit(":", 1), n)
            else:
                masked.add_metric([key], n)
        yield hits
        yield masked


def make_state(config: Config, previous: Any) -> Any:
    if config.guard is None and config.redact is None:
        return None
    return GuardFactory(config, previous.counts if isinstance(previous, GuardFactory) else {})


def build(config: Config, route: RouteConfig, state: GuardFactory) -> FilterFactory:
    return state
